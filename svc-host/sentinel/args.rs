//! The sentinel's command line, `HOST_PID UID:GID|- -- PROGRAM ARGV0 [ARGS...]` (written by
//! `isolation::sentinel_args`). Only `core`: the sentinel (`main.rs`) and svc-host's tests share
//! this file.

/// What the sentinel's arguments say; PROGRAM is argument 3, the provider's argv from 4 on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parsed {
    /// The host's pid: the sentinel's parent must be this process.
    pub host: i32,
    /// The provider's uid and gid; None: the host's own.
    pub who: Option<(u32, u32)>,
}

pub const USAGE: &str = "usage: agentscope-sentinel HOST_PID UID:GID|- -- PROGRAM ARGV0 [ARGS...]";

/// `n` arguments (after the sentinel's own name); `arg(i)` is argument `i`'s bytes.
pub fn parse<'a>(n: usize, arg: impl Fn(usize) -> &'a [u8]) -> Result<Parsed, &'static str> {
    if n < 5 || arg(2) != b"--" {
        return Err(USAGE);
    }
    let host = number(arg(0))
        .filter(|p| *p > 0 && *p <= i32::MAX as u32)
        .ok_or("bad host pid")? as i32;
    let who = match arg(1) {
        b"-" => None,
        w => {
            let colon = w.iter().position(|c| *c == b':').ok_or("bad uid:gid")?;
            let uid = number(&w[..colon]).ok_or("bad uid")?;
            let gid = number(&w[colon + 1..]).ok_or("bad gid")?;
            Some((uid, gid))
        }
    };
    Ok(Parsed { host, who })
}

/// A decimal u32 without sign, spaces or leading `+`.
fn number(s: &[u8]) -> Option<u32> {
    if s.is_empty() || s.len() > 10 {
        return None;
    }
    let mut n: u64 = 0;
    for c in s {
        if !c.is_ascii_digit() {
            return None;
        }
        n = n * 10 + (c - b'0') as u64;
    }
    u32::try_from(n).ok()
}
