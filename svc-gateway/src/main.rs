#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = svc_gateway::Config::load()?;
    let _telemetry = agentscope_telemetry::init(
        "svc-gateway",
        &agentscope_telemetry::Options {
            log_format: config.log_format.clone(),
        },
    )?;
    let app = svc_gateway::App::build(config).await?;
    app.run_until_stopped(agentscope_telemetry::health::shutdown_signal())
        .await
}
