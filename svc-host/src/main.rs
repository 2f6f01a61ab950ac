#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = svc_host::Config::load()?;
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
