//! The Vault's API: tool credentials are sealed here (AES-256-GCM, key from configuration) and
//! opened only by the dataplane when a tool that needs them runs. No route ever returns a value.

use crate::AppState;
use crate::error::{ApiError, ApiResult};
use crate::extract::{Auth, Body};
use agentscope_api as t;
use agentscope_api::NewSecret;
use agentscope_domain::vault::{Keyring, Sealed};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use sqlx::Connection as _;

fn keyring(s: &AppState) -> ApiResult<Keyring> {
    Keyring::parse(&s.config.vault_keys.0)
        .ok()
        .flatten()
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "vault_not_configured",
                "no vault key is configured (AGENTSCOPE_VAULT_KEYS); secrets cannot be stored",
            )
        })
}

pub async fn put(
    State(s): State<AppState>,
    auth: Auth,
    Body(b): Body<NewSecret>,
) -> ApiResult<(StatusCode, Json<t::SecretStored>)> {
    let valid_name = !b.name.is_empty()
        && b.name.len() <= 128
        && b.name
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        && !b.name.starts_with(|c: char| c.is_ascii_digit());
    if !valid_name {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`name` must be an environment variable name: A-Z, 0-9 and _, not starting with a digit",
        ));
    }
    if b.value.len() < 4 || b.value.len() > 64 * 1024 {
        return Err(ApiError::bad_request(
            "invalid_field",
            "`value` must be 4 bytes to 64 KiB (shorter values could not be redacted reliably)",
        ));
    }
    let keys = keyring(&s)?;
    let ws = auth.workspace_id.to_string();
    let sealed = keys
        .seal(&ws, &b.name, b.value.as_bytes())
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    sqlx::query!(
        "INSERT INTO vault_secrets (workspace_id, name, key_id, nonce, ciphertext) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (workspace_id, name) DO UPDATE SET key_id = EXCLUDED.key_id, nonce = EXCLUDED.nonce,
             ciphertext = EXCLUDED.ciphertext, updated_at = now()",
        auth.workspace_id,
        &b.name,
        &sealed.key_id,
        &sealed.nonce[..],
        &sealed.ciphertext[..],
    )
    .execute(&s.db)
    .await?;
    Ok((
        StatusCode::CREATED,
        Json(t::SecretStored {
            name: b.name,
            key_id: sealed.key_id,
        }),
    ))
}

pub async fn list(State(s): State<AppState>, auth: Auth) -> ApiResult<Json<t::SecretList>> {
    let items = sqlx::query_as!(
        t::Secret,
        "SELECT name, key_id, created_at, updated_at
         FROM vault_secrets WHERE workspace_id = $1 ORDER BY name",
        auth.workspace_id,
    )
    .fetch_all(&s.db)
    .await?;
    Ok(Json(t::SecretList { items }))
}

/// Key rotation: re-seals every secret of the workspace under the current (first) key.
pub async fn rotate(State(s): State<AppState>, auth: Auth) -> ApiResult<Json<t::Rotated>> {
    let keys = keyring(&s)?;
    let ws = auth.workspace_id.to_string();
    let mut conn = s.db.acquire().await?;
    let mut tx = conn.begin().await?;
    let rows = sqlx::query!(
        "SELECT name, key_id, nonce, ciphertext FROM vault_secrets WHERE workspace_id = $1 FOR UPDATE",
        auth.workspace_id,
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut moved = 0;
    for r in rows {
        let name = r.name;
        let sealed = Sealed {
            key_id: r.key_id,
            nonce: r.nonce,
            ciphertext: r.ciphertext,
        };
        let resealed = keys
            .reseal(&ws, &name, &sealed)
            .map_err(|e| ApiError::conflict("vault_key_missing", format!("secret {name}: {e}")))?;
        if let Some(n) = resealed {
            sqlx::query!(
                "UPDATE vault_secrets SET key_id = $3, nonce = $4, ciphertext = $5, updated_at = now() WHERE workspace_id = $1 AND name = $2",
                auth.workspace_id,
                &name,
                &n.key_id,
                &n.nonce[..],
                &n.ciphertext[..],
            )
            .execute(&mut *tx)
            .await?;
            moved += 1;
        }
    }
    tx.commit().await?;
    conn.release();
    Ok(Json(t::Rotated {
        resealed: moved,
        key_id: keys.current_key_id().to_string(),
    }))
}
