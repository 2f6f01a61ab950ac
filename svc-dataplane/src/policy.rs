//! Tool policy of an agent version: allow, ask or deny, per tool and per argument pattern.
//!
//! ```json
//! {"default": "allow",
//!  "tools": {"shell": "ask"},
//!  "rules": [{"tool": "shell", "match": "rm *", "decision": "deny"}]}
//! ```
//! Rules are tried in order against the tool's main argument (a file path, a memory query or
//! text), `*` matching any run of characters and `?` one; then the per-tool setting; then the
//! default (allow).
//!
//! A shell command line is decided per simple command: it is parsed ([`shell`]) into every
//! simple command it would run (sequences, pipelines, subshells, substitutions, wrappers such as
//! `env` or `sudo`, nested `sh -c` and `eval`, with quotes removed and program paths also tried
//! by their basename), each is decided as above, and the line gets the strictest of those
//! decisions (deny > ask > allow). A line that cannot be analysed without running it (see
//! [`shell::Opaque`]) gets the strictest decision any shell rule, the shell's tool setting or the
//! default could give.

pub mod shell;

use serde::Deserialize;
use serde_json::Value;
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    Allow,
    Ask,
    Deny,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub tool: String,
    #[serde(rename = "match")]
    pub pattern: String,
    pub decision: Decision,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    #[serde(default = "allow")]
    pub default: Decision,
    #[serde(default)]
    pub tools: HashMap<String, Decision>,
    #[serde(default)]
    pub rules: Vec<Rule>,
    /// How long an `ask` may wait for a decision before it becomes a deny (default 600 s).
    #[serde(default)]
    pub approval_timeout_secs: Option<u32>,
    /// Vault secrets the shell tool gets as environment variables (by name). Every tool's output
    /// is redacted of their values.
    #[serde(default)]
    pub secrets: Vec<String>,
}

impl Decision {
    /// deny > ask > allow.
    fn severity(self) -> u8 {
        match self {
            Decision::Allow => 0,
            Decision::Ask => 1,
            Decision::Deny => 2,
        }
    }
}

fn allow() -> Decision {
    Decision::Allow
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            default: Decision::Allow,
            tools: HashMap::new(),
            rules: vec![],
            approval_timeout_secs: None,
            secrets: vec![],
        }
    }
}

impl Policy {
    /// The policy stored with an agent version; `{}` or null is allow-all.
    pub fn from_json(v: &Value) -> Result<Policy, String> {
        if v.is_null() {
            return Ok(Policy::default());
        }
        serde_json::from_value(v.clone()).map_err(|e| format!("invalid tool policy: {e}"))
    }

    /// The decision for `tool` called with `input`, and the rule that made it.
    pub fn decide(&self, tool: &str, input: &Value) -> (Decision, String) {
        let arg = main_argument(tool, input);
        if tool != "shell" {
            return self.decide_one(tool, &arg);
        }
        match shell::simple_commands(&arg) {
            Ok(commands) if commands.is_empty() => self.decide_one(tool, ""),
            Ok(commands) => {
                let mut worst: Option<(Decision, String)> = None;
                for c in &commands {
                    let (d, why) = self.decide_one(tool, c);
                    if worst
                        .as_ref()
                        .is_none_or(|(w, _)| d.severity() > w.severity())
                    {
                        worst = Some((d, format!("{why} for `{c}`")));
                    }
                }
                worst.unwrap_or_else(|| self.decide_one(tool, ""))
            }
            Err(shell::Opaque(why)) => {
                let strictest = self
                    .rules
                    .iter()
                    .filter(|r| r.tool == tool || r.tool == "*")
                    .map(|r| r.decision)
                    .chain([self.tools.get(tool).copied().unwrap_or(self.default)])
                    .max_by_key(|d| d.severity())
                    .unwrap_or(self.default);
                (
                    strictest,
                    format!(
                        "the command line cannot be analysed ({why}): the strictest shell decision applies"
                    ),
                )
            }
        }
    }

    /// The first rule of `tool` matching `arg`, else the tool's setting, else the default.
    fn decide_one(&self, tool: &str, arg: &str) -> (Decision, String) {
        for r in &self.rules {
            if (r.tool == tool || r.tool == "*") && glob(&r.pattern, arg) {
                return (
                    r.decision,
                    format!("rule {{tool: {}, match: {:?}}}", r.tool, r.pattern),
                );
            }
        }
        if let Some(d) = self.tools.get(tool) {
            return (*d, format!("tools.{tool}"));
        }
        (self.default, "default".into())
    }
}

/// The argument a rule pattern is matched against.
pub fn main_argument(tool: &str, input: &Value) -> String {
    let key = match tool {
        "shell" => "command",
        "memory_search" => "query",
        "memory_write" | "comment" => "text",
        _ => "path",
    };
    input
        .get(key)
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string()
}

/// `*` any run of characters, `?` any one; everything else literal.
pub fn glob(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn globs() {
        for (p, t, want) in [
            ("rm *", "rm -rf /", true),
            ("rm *", "echo rm", false),
            ("*secret*", "cat my-secret.txt", true),
            ("a?c", "abc", true),
            ("a?c", "ac", false),
            ("", "", true),
            ("*", "", true),
            ("**x", "abx", true),
        ] {
            assert_eq!(glob(p, t), want, "{p} ~ {t}");
        }
    }

    #[test]
    fn rules_then_tools_then_default() {
        let p = Policy::from_json(&json!({
            "default": "allow",
            "tools": {"shell": "ask", "write_file": "deny"},
            "rules": [{"tool": "shell", "match": "rm *", "decision": "deny"},
                      {"tool": "shell", "match": "echo *", "decision": "allow"}]
        }))
        .unwrap();
        assert_eq!(
            p.decide("shell", &json!({"command": "rm -rf x"})).0,
            Decision::Deny
        );
        assert_eq!(
            p.decide("shell", &json!({"command": "echo hi"})).0,
            Decision::Allow
        );
        assert_eq!(
            p.decide("shell", &json!({"command": "ls"})).0,
            Decision::Ask
        );
        assert_eq!(
            p.decide("write_file", &json!({"path": "a"})).0,
            Decision::Deny
        );
        assert_eq!(
            p.decide("read_file", &json!({"path": "a"})).0,
            Decision::Allow
        );
        assert_eq!(
            Policy::from_json(&json!({}))
                .unwrap()
                .decide("shell", &json!({}))
                .0,
            Decision::Allow
        );
    }

    fn deny_rm() -> Policy {
        Policy::from_json(&json!({
            "rules": [{"tool": "shell", "match": "rm *", "decision": "deny"}]
        }))
        .unwrap()
    }

    #[test]
    fn a_shell_rule_matches_every_simple_command_of_the_line() {
        let p = deny_rm();
        for line in [
            "rm -rf x",
            "cd . && rm -rf x",
            "/bin/rm -rf x",
            "echo $(rm -rf x)",
            "echo `rm -rf x`",
            "sh -c \"rm -rf x\"",
            "bash -c 'cd . ; rm -rf x'",
            "eval 'rm -rf x'",
            "(rm -rf x)",
            "{ rm -rf x; }",
            "ls | rm -rf x",
            "true || rm -rf x",
            "cat <(rm -rf x)",
            "FOO=1 rm -rf x",
            "env rm -rf x",
            "command rm -rf x",
            "exec rm -rf x",
            "nice rm -rf x",
            "nohup rm -rf x",
            "timeout 5 rm -rf x",
            "echo x | xargs rm -rf",
            "sudo rm -rf x",
            "busybox rm -rf x",
            "r\"\"m -rf x",
            "\\rm -rf x",
            "echo \"$(rm -rf x)\"",
        ] {
            let (d, why) = p.decide("shell", &json!({"command": line}));
            assert_eq!(d, Decision::Deny, "{line:?}: {why}");
        }
        for line in ["echo 'rm -rf x'", "ls -l", "cd . && ls", "grep rm file"] {
            let (d, why) = p.decide("shell", &json!({"command": line}));
            assert_eq!(d, Decision::Allow, "{line:?}: {why}");
        }
    }

    #[test]
    fn a_line_gets_the_strictest_decision_of_its_commands() {
        let p = Policy::from_json(&json!({
            "tools": {"shell": "ask"},
            "rules": [{"tool": "shell", "match": "echo *", "decision": "allow"},
                      {"tool": "shell", "match": "ls*", "decision": "allow"},
                      {"tool": "shell", "match": "curl *", "decision": "deny"}]
        }))
        .unwrap();
        let d = |c: &str| p.decide("shell", &json!({"command": c})).0;
        assert_eq!(d("echo a && ls"), Decision::Allow);
        assert_eq!(d("echo a && make"), Decision::Ask);
        assert_eq!(d("echo $(curl http://x) && make"), Decision::Deny);
        let (dec, why) = p.decide("shell", &json!({"command": "echo a; curl -s x"}));
        assert_eq!(dec, Decision::Deny);
        assert!(why.contains("curl -s x"), "{why}");
    }

    #[test]
    fn an_opaque_line_gets_the_strictest_shell_decision() {
        let p = deny_rm();
        for line in [
            "echo 'unbalanced",
            "$X -rf x",
            "echo rm -rf x | sh",
            "/bin/r? -rf x",
        ] {
            let (d, why) = p.decide("shell", &json!({"command": line}));
            assert_eq!(d, Decision::Deny, "{line:?}: {why}");
            assert!(why.contains("cannot be analysed"), "{why}");
        }
        // With only allow rules and an `ask` shell, the strictest is ask.
        let p = Policy::from_json(&json!({
            "tools": {"shell": "ask"},
            "rules": [{"tool": "shell", "match": "ls*", "decision": "allow"}]
        }))
        .unwrap();
        assert_eq!(
            p.decide("shell", &json!({"command": "$X"})).0,
            Decision::Ask
        );
        // Allow-all stays allow-all.
        assert_eq!(
            Policy::default()
                .decide("shell", &json!({"command": "$X"}))
                .0,
            Decision::Allow
        );
        // Other tools are matched on their argument as before.
        assert_eq!(
            p.decide("read_file", &json!({"path": "a'b"})).0,
            Decision::Allow
        );
    }

    #[test]
    fn a_bad_policy_is_refused_by_name() {
        let e = Policy::from_json(&json!({"default": "maybe"})).unwrap_err();
        assert!(e.contains("maybe"), "{e}");
        assert!(Policy::from_json(&json!({"colour": "blue"})).is_err());
    }
}
