#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = svc_dataplane::Config::load()?;
    let _telemetry = agentscope_telemetry::init(
        "svc-dataplane",
        &agentscope_telemetry::Options {
            log_format: config.log_format.clone(),
        },
    )?;
    let app = svc_dataplane::App::build(config).await?;
    app.run_until_stopped(agentscope_telemetry::health::shutdown_signal())
        .await
}
