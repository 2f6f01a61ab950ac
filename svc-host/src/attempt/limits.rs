//! What ends a run early: its timeout, and a model endpoint that does not answer.

use std::time::Duration;

/// Counts a provider's model connection errors in a row (a CLI retrying an endpoint that does
/// not answer); any model output in between starts the count over.
#[derive(Debug, Default)]
pub struct ModelWatch {
    errors: u32,
    first: Option<std::time::Instant>,
}

impl ModelWatch {
    /// One more connection error. Some((errors, seconds since the first)) when the attempt
    /// should end: `limit` errors in a row, or the first of them `max` ago.
    pub fn connection_error(&mut self, limit: u32, max: Duration) -> Option<(u32, u64)> {
        self.errors += 1;
        let first = *self.first.get_or_insert_with(std::time::Instant::now);
        let since = first.elapsed();
        (self.errors >= limit.max(1) || since >= max).then_some((self.errors, since.as_secs()))
    }

    /// The model answered.
    pub fn progress(&mut self) {
        self.errors = 0;
        self.first = None;
    }
}

/// The run timeout of an attempt, from the scheduler's resolution (task, then runtime profile,
/// then the deployment default), and the words naming the limit that applies.
pub fn run_limit(spec: &super::Spec) -> (Duration, String) {
    /// An attempt whose spec carries no timeout (created before timeouts were resolved).
    const FALLBACK_SECS: u64 = 4 * 3600;
    let secs = match spec.timeout_secs {
        0 => FALLBACK_SECS,
        s => s as u64,
    };
    let limit = match spec.timeout_source.as_str() {
        "task" => format!("the task's timeout_secs ({secs} s)"),
        "profile" => format!("the runtime profile's timeout_secs ({secs} s)"),
        _ => format!(
            "the deployment's default run timeout ({secs} s, AGENTSCOPE_RUN_TIMEOUT_SECS of the scheduler and the gateway)"
        ),
    };
    (Duration::from_secs(secs), limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_connection_errors_end_the_run_and_progress_resets_them() {
        let mut w = ModelWatch::default();
        let long = Duration::from_secs(3600);
        assert_eq!(w.connection_error(3, long), None);
        assert_eq!(w.connection_error(3, long), None);
        w.progress();
        assert_eq!(w.connection_error(3, long), None);
        assert_eq!(w.connection_error(3, long), None);
        assert_eq!(w.connection_error(3, long).map(|(n, _)| n), Some(3));
        // The seconds bound ends it before the count does.
        let mut w = ModelWatch::default();
        assert!(w.connection_error(100, Duration::ZERO).is_some());
    }

    #[test]
    fn the_timeout_names_its_limit() {
        let spec = |secs, source: &str| super::super::Spec {
            timeout_secs: secs,
            timeout_source: source.into(),
            ..Default::default()
        };
        let (d, l) = run_limit(&spec(2, "profile"));
        assert_eq!(d, Duration::from_secs(2));
        assert!(l.contains("runtime profile's timeout_secs"), "{l}");
        let (d, l) = run_limit(&spec(7, "task"));
        assert_eq!(d, Duration::from_secs(7));
        assert!(l.contains("task's timeout_secs"), "{l}");
        let (d, l) = run_limit(&spec(0, ""));
        assert_eq!(d, Duration::from_secs(4 * 3600));
        assert!(l.contains("default"), "{l}");
    }
}
