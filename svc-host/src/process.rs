//! Provider processes: bounded reading of their output lines, and termination of a process
//! group (and of whatever left it, found by the attempt's marker variable).

use std::time::Duration;
use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// Reads one line of at most `max` bytes; the rest of a longer line is discarded and the line is
/// marked truncated. Invalid UTF-8 is replaced, never rejected. None at end of input.
pub async fn read_line_bounded<R: AsyncBufRead + Unpin>(
    r: &mut R,
    max: usize,
) -> std::io::Result<Option<(String, bool)>> {
    let mut buf = Vec::new();
    let mut truncated = false;
    let mut saw_any = false;
    loop {
        let chunk = r.fill_buf().await?;
        if chunk.is_empty() {
            if !saw_any {
                return Ok(None);
            }
            break;
        }
        saw_any = true;
        let (take, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (i, true),
            None => (chunk.len(), false),
        };
        let room = max.saturating_sub(buf.len());
        if take > room {
            truncated = true;
        }
        buf.extend_from_slice(&chunk[..take.min(room)]);
        r.consume(if done { take + 1 } else { take });
        if done {
            break;
        }
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(Some((
        String::from_utf8_lossy(&buf).into_owned(),
        truncated,
    )))
}

/// Every process id in `/proc`.
pub fn proc_pids() -> impl Iterator<Item = i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
}

/// Ids of live (non-zombie) processes in process group `pgid`, read from /proc.
pub fn group_members(pgid: i32) -> Vec<i32> {
    proc_pids()
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            // pid (comm) state ppid pgrp ...; comm may contain spaces and parentheses.
            let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
                return false;
            };
            let mut f = rest.split_whitespace();
            let state = f.next().unwrap_or("Z");
            let pgrp = f.nth(1).and_then(|s| s.parse::<i32>().ok());
            pgrp == Some(pgid) && state != "Z" && state != "X"
        })
        .collect()
}

/// Live processes whose environment carries `marker` (e.g. `AGENTSCOPE_ATTEMPT_ID=<id>`): a
/// provider's whole tree, including children that left its process group.
pub fn marked_processes(marker: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    proc_pids()
        .filter(|pid| *pid != me)
        .filter(|pid| {
            let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .map(|(_, r)| r.split_whitespace().next().unwrap_or("Z").to_string())
                })
                .is_some_and(|st| st != "Z" && st != "X");
            alive
                && std::fs::read(format!("/proc/{pid}/environ"))
                    .map(|env| env.split(|b| *b == 0).any(|kv| kv == marker.as_bytes()))
                    .unwrap_or(false)
        })
        .collect()
}

/// SIGKILLs every process carrying `marker` until none is left (or 10 s pass); the survivors.
pub async fn kill_marked(marker: &str) -> Vec<i32> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let m = marker.to_string();
        let left = tokio::task::spawn_blocking(move || marked_processes(&m))
            .await
            .unwrap_or_default();
        if left.is_empty() || tokio::time::Instant::now() >= deadline {
            return left;
        }
        for pid in &left {
            // SAFETY: plain signal to a process of this attempt.
            unsafe {
                libc::kill(*pid, libc::SIGKILL);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Stops an attempt's provider tree whose sentinel leads process group `pgid`: the sentinel is
/// told to end whatever is left once the provider is gone; SIGTERM to the group, SIGKILL after
/// `grace` (at once without one); then whatever still carries the attempt's `marker` (a
/// sentinel killed by the group's SIGKILL leaves the orphans it adopted behind). The survivors.
pub async fn stop_tree(pgid: i32, grace: Option<Duration>, marker: &str) -> Vec<i32> {
    crate::isolation::end_rest(pgid);
    let mut left = match grace {
        Some(grace) => terminate_group(pgid, grace).await,
        None => kill_group(pgid).await,
    };
    left.extend(kill_marked(marker).await);
    left
}

/// Sends `signal` to every process of group `pgid`. Never to 0 (the host's own group) or 1
/// (`kill(-1)`: every process the host may signal): a child whose pid is unknown has pgid 0.
pub fn signal_group(pgid: i32, signal: i32) {
    if pgid <= 1 {
        return;
    }
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
    unsafe {
        libc::kill(-pgid, signal);
    }
}

/// SIGTERM, then SIGKILL after `grace`; returns once no process of the group is left (or after
/// a further 10 s, returning the survivors).
pub async fn terminate_group(pgid: i32, grace: Duration) -> Vec<i32> {
    signal_group(pgid, libc::SIGTERM);
    if wait_group_empty(pgid, grace).await {
        return vec![];
    }
    signal_group(pgid, libc::SIGKILL);
    if wait_group_empty(pgid, Duration::from_secs(10)).await {
        return vec![];
    }
    members(pgid).await
}

/// Kills the whole group at once (lease lost: the work must stop now).
pub async fn kill_group(pgid: i32) -> Vec<i32> {
    signal_group(pgid, libc::SIGKILL);
    if wait_group_empty(pgid, Duration::from_secs(10)).await {
        return vec![];
    }
    members(pgid).await
}

/// [`group_members`] on the blocking pool: a scan of /proc never holds up the host's tasks.
async fn members(pgid: i32) -> Vec<i32> {
    tokio::task::spawn_blocking(move || group_members(pgid))
        .await
        .unwrap_or_default()
}

async fn wait_group_empty(pgid: i32, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let empty = tokio::task::spawn_blocking(move || group_members(pgid).is_empty())
            .await
            .unwrap_or(false);
        if empty {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn long_lines_are_truncated_and_bad_utf8_is_replaced() {
        let mut input: Vec<u8> = vec![b'a'; 5000];
        input.push(b'\n');
        input.extend_from_slice(&[0xff, 0xfe, b'o', b'k', b'\n', b't', b'a', b'i', b'l']);
        let mut r = tokio::io::BufReader::with_capacity(64, &input[..]);
        let (l1, t1) = read_line_bounded(&mut r, 1024).await.unwrap().unwrap();
        assert_eq!((l1.len(), t1), (1024, true));
        let (l2, t2) = read_line_bounded(&mut r, 1024).await.unwrap().unwrap();
        assert!(l2.ends_with("ok") && !t2, "{l2:?}");
        let (l3, _) = read_line_bounded(&mut r, 1024).await.unwrap().unwrap();
        assert_eq!(l3, "tail");
        assert!(read_line_bounded(&mut r, 1024).await.unwrap().is_none());
    }
}
