//! PostgreSQL access shared by the services: connecting and migrating.
//! Queries live with the service that owns the table (ARCHITECTURE.md, "Data ownership").

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use std::str::FromStr;
use std::time::Duration;

pub use sqlx;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid database url")]
    Url(#[source] sqlx::Error),
    #[error("connect to postgres")]
    Connect(#[source] sqlx::Error),
    #[error("run migrations")]
    Migrate(#[source] sqlx::migrate::MigrateError),
}

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Connect with a bounded pool; fails fast (10 s) when Postgres is unreachable.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, Error> {
    let options = PgConnectOptions::from_str(url).map_err(Error::Url)?;
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .map_err(Error::Connect)
}

/// Apply pending migrations. Safe to call from several services at once (sqlx takes an advisory lock).
pub async fn migrate(pool: &PgPool) -> Result<(), Error> {
    MIGRATOR.run(pool).await.map_err(Error::Migrate)?;
    tracing::info!("database schema is current");
    Ok(())
}
