fn main() -> anyhow::Result<()> {
    let config = svc_host::Config::load()?;
    agentscope_telemetry::runtime(config.worker_threads)?.block_on(run(config))
}

async fn run(config: svc_host::Config) -> anyhow::Result<()> {
    let _telemetry = agentscope_telemetry::init(
        "svc-host",
        &agentscope_telemetry::Options {
            log_format: config.log_format.clone(),
        },
    )?;
    let app = svc_host::App::build(config).await?;
    app.run_until_stopped(agentscope_telemetry::health::shutdown_signal())
        .await
}
