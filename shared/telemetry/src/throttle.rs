//! Rate-limited logging for warnings that repeat in bursts (a database outage makes every
//! message fail the same way): the first occurrence is logged, then at most one line per
//! interval, which says how many were left out since the previous line.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One throttled log site. Usually a `static`:
///
/// ```ignore
/// static RETRY: Throttle = Throttle::new(Duration::from_secs(5));
/// if let Some(more) = RETRY.check() {
///     tracing::warn!(error = ?e, "record failed; will retry{}", more);
/// }
/// ```
pub struct Throttle {
    interval: Duration,
    state: Mutex<State>,
}

struct State {
    last: Option<Instant>,
    suppressed: u64,
}

/// How many occurrences were left out before the line being logged; displays as
/// ` (N more since)`, or nothing when none were.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suppressed(pub u64);

impl std::fmt::Display for Suppressed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0 > 0 {
            write!(f, " ({} more since)", self.0)
        } else {
            Ok(())
        }
    }
}

impl Throttle {
    pub const fn new(interval: Duration) -> Self {
        Throttle {
            interval,
            state: Mutex::new(State {
                last: None,
                suppressed: 0,
            }),
        }
    }

    /// Counts one occurrence. `Some` when it should be logged now (with how many were left out
    /// since the previous logged line), `None` when it is left out.
    pub fn check(&self) -> Option<Suppressed> {
        self.check_at(Instant::now())
    }

    fn check_at(&self, now: Instant) -> Option<Suppressed> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match s.last {
            Some(last) if now.saturating_duration_since(last) < self.interval => {
                s.suppressed += 1;
                None
            }
            _ => {
                s.last = Some(now);
                Some(Suppressed(std::mem::take(&mut s.suppressed)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_occurrence_then_one_line_per_interval_with_the_count() {
        let t = Throttle::new(Duration::from_secs(5));
        let t0 = Instant::now();
        assert_eq!(t.check_at(t0), Some(Suppressed(0)));
        for i in 1..=1103u64 {
            assert_eq!(t.check_at(t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(
            t.check_at(t0 + Duration::from_secs(5)),
            Some(Suppressed(1103))
        );
        assert_eq!(t.check_at(t0 + Duration::from_secs(6)), None);
        assert_eq!(
            t.check_at(t0 + Duration::from_secs(11)),
            Some(Suppressed(1))
        );
        assert_eq!(Suppressed(0).to_string(), "");
        assert_eq!(Suppressed(44).to_string(), " (44 more since)");
    }
}
