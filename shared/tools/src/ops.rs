//! The file and shell tools (`read_file`, `write_file`, `edit_file`, `list_files`, `shell`) as a
//! model sees them: arguments from the call's JSON input, the result as text, capped.

use crate::env::{Environment, Gate, Limits};
use serde_json::Value;

/// Longest tool output the model sees.
pub const MAX_OUTPUT: usize = 64 * 1024;

/// What a tool call produced: the text the model sees and whether it is an error.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutput {
    pub output: String,
    pub is_error: bool,
}

impl ToolOutput {
    pub fn ok(s: impl Into<String>) -> Self {
        ToolOutput {
            output: cap(s.into()),
            is_error: false,
        }
    }
    pub fn err(s: impl Into<String>) -> Self {
        ToolOutput {
            output: cap(s.into()),
            is_error: true,
        }
    }
}

fn cap(mut s: String) -> String {
    if s.len() > MAX_OUTPUT {
        let mut end = MAX_OUTPUT;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("\n[truncated]");
    }
    s
}

fn arg<'a>(input: &'a Value, key: &str) -> Result<&'a str, ToolOutput> {
    input
        .get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| ToolOutput::err(format!("bad_arguments: `{key}` (a string) is required")))
}

/// Runs a file or shell tool in `env` (the dataplane's memory and issue tools are its own).
pub async fn run(
    env: &Environment,
    limits: &Limits,
    name: &str,
    input: &Value,
    shell_env: &[(String, String)],
) -> ToolOutput {
    run_after(env, limits, name, input, shell_env, None).await
}

/// [`run`] once `gate` (if any) opens: a shell command gets ready meanwhile (see
/// [`Environment::shell_after`]), any other tool waits for it first. A gate that stays shut
/// fails the call (`not_started`) without effects.
pub async fn run_after(
    env: &Environment,
    limits: &Limits,
    name: &str,
    input: &Value,
    shell_env: &[(String, String)],
    gate: Option<Gate>,
) -> ToolOutput {
    let gate = match gate {
        Some(g) if name != "shell" => {
            if let Err(e) = g.wait().await {
                return ToolOutput::err(e.to_string());
            }
            None
        }
        g => g,
    };
    let r = async {
        Ok::<ToolOutput, ToolOutput>(match name {
            "read_file" => match env.read_file(arg(input, "path")?, limits).await {
                Ok(text) => ToolOutput::ok(text),
                Err(e) => ToolOutput::err(e.to_string()),
            },
            "write_file" => {
                let (path, content) = (arg(input, "path")?, arg(input, "content")?);
                match env.write_file(path, content, limits).await {
                    Ok(()) => ToolOutput::ok(format!("wrote {} bytes to {path}", content.len())),
                    Err(e) => ToolOutput::err(e.to_string()),
                }
            }
            "edit_file" => {
                let path = arg(input, "path")?;
                match env
                    .edit_file(
                        path,
                        arg(input, "old_text")?,
                        arg(input, "new_text")?,
                        limits,
                    )
                    .await
                {
                    Ok(()) => ToolOutput::ok(format!("edited {path}")),
                    Err(e) => ToolOutput::err(e.to_string()),
                }
            }
            "list_files" => {
                let path = input.get("path").and_then(Value::as_str).unwrap_or("");
                match env.list_files(path).await {
                    Ok(entries) => ToolOutput::ok(entries.join("\n")),
                    Err(e) => ToolOutput::err(e.to_string()),
                }
            }
            "shell" => match env
                .shell_after(arg(input, "command")?, shell_env, limits, gate)
                .await
            {
                Ok(out) => {
                    let status = match (out.timed_out, out.exit_code) {
                        (true, _) => "timed out".to_string(),
                        (false, Some(c)) => format!("exit code {c}"),
                        (false, None) => "killed by a signal".to_string(),
                    };
                    let text = format!("{}\n[{status}]", out.output);
                    if out.exit_code == Some(0) && !out.timed_out {
                        ToolOutput::ok(text)
                    } else {
                        ToolOutput::err(text)
                    }
                }
                Err(e) => ToolOutput::err(e.to_string()),
            },
            other => ToolOutput::err(format!("unknown_tool: no tool named `{other}`")),
        })
    }
    .await;
    r.unwrap_or_else(|e| e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_capped_on_a_char_boundary() {
        let s = "é".repeat(MAX_OUTPUT);
        let c = cap(s);
        assert!(c.len() <= MAX_OUTPUT + 20 && c.ends_with("[truncated]"));
    }
}
