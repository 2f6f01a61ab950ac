//! `agentscope-modelsim --listen 127.0.0.1:0 --script FILE [--log FILE]`: serves a script; the
//! first stdout line is `listening on http://ADDR`.

use std::io::Write;
use std::path::PathBuf;

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "agentscope-modelsim",
    about = "Scripted model server for provider CLIs"
)]
struct Args {
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Script file: {"turns": [{"say", "tool", "args", "expect"}...], "final": "..."}.
    #[arg(long)]
    script: PathBuf,
    /// Append one JSON line per request to this file.
    #[arg(long)]
    log: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _guard = agentscope_telemetry::init(
        "agentscope-modelsim",
        &agentscope_telemetry::Options::default(),
    )?;
    let script = agentscope_modelsim::Script::from_file(&args.script)?;
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("binding {}: {e}", args.listen))?;
    let addr = listener.local_addr()?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on http://{addr}")?;
        out.flush()?;
    }
    tokio::select! {
        r = agentscope_modelsim::serve(listener, script, args.log) => r,
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}
