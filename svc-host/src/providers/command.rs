//! The `command` provider: a configured argv run in the task directory.

use crate::provider::{Adapter, Launch, LaunchCtx, Refusal, base_env};
use crate::providers::StreamParser;
use agentscope_domain::Provider;
use agentscope_schemas::v1::{Output, ProviderDescriptor, execution_event::Body};

/// Runs a configured command line in the task directory; each output line is an event and the
/// exit status decides success.
pub struct CommandProvider;

struct CommandParser;

impl StreamParser for CommandParser {
    fn line(&mut self, line: &str, truncated: bool) -> Vec<Body> {
        vec![Body::Output(Output {
            stream: "stdout".into(),
            text: line.to_string(),
            truncated,
        })]
    }
    fn finish(&mut self) -> Vec<Body> {
        vec![]
    }
    fn session_id(&self) -> Option<&str> {
        None
    }
}

impl Adapter for CommandProvider {
    fn provider(&self) -> Provider {
        Provider::Command
    }

    fn discover(&self) -> ProviderDescriptor {
        ProviderDescriptor {
            name: self.name().into(),
            installed: true,
            version: env!("CARGO_PKG_VERSION").into(),
            logged_in: true,
            detail: "runs the runtime profile's `command` argv".into(),
            live_stream: true,
            resume: false,
        }
    }

    fn launch(&self, ctx: &LaunchCtx) -> Result<Launch, Refusal> {
        let spec = ctx.spec;
        if let Some(unknown) = spec
            .params
            .keys()
            .find(|k| !["timeout_secs"].contains(&k.as_str()))
        {
            return Err(Refusal::bad_parameter(format!(
                "unknown parameter `{unknown}` for provider command"
            )));
        }
        if spec.command.is_empty() || spec.command[0].is_empty() {
            return Err(Refusal::bad_parameter(
                "`command` is empty: set params.command to an argv array on the runtime profile",
            ));
        }
        Ok(Launch {
            argv: spec.command.clone(),
            cwd: ctx.dir.workdir().to_path_buf(),
            env: base_env(ctx.dir),
            ..Default::default()
        })
    }

    fn parser(&self) -> Box<dyn StreamParser> {
        Box::new(CommandParser)
    }

    fn max_line_bytes(&self) -> usize {
        64 * 1024
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attempt::Spec;
    use crate::provider::TaskDir;
    use agentscope_domain::FailureClass;

    #[test]
    fn command_provider_refuses_unknown_parameters_by_name() {
        let dir = TaskDir {
            root: "/tmp".into(),
            repo: None,
            input_dir: "/tmp".into(),
            home: "/tmp".into(),
            tmp: "/tmp".into(),
        };
        let mut spec = Spec {
            command: vec!["true".into()],
            ..Default::default()
        };
        spec.params.insert("colour".into(), "blue".into());
        let ctx = LaunchCtx {
            spec: &spec,
            dir: &dir,
            attempt_id: "a",
            api_url: "http://x",
            task_token: "agt_x",
            cli: std::path::Path::new("/bin/agentscope"),
        };
        let err = CommandProvider.launch(&ctx).unwrap_err();
        assert_eq!(err.class, FailureClass::BadParameters);
        assert!(err.detail.contains("colour"));
    }
}
