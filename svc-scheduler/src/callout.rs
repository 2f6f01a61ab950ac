//! The NATS auth callout: lets Runtime Hosts and self-hosted Workers into NATS with permissions
//! for their own subjects only (see `agentscope_bus::auth`).
//!
//! A host connects with its host id as the user and its host token as the password; a Worker
//! with its name and its worker token. The token is checked like any API token (hashed, not
//! revoked, of the right kind); a host id already registered in another workspace is refused.

use crate::{Ctx, Error};
use agentscope_bus::Endpoint;
use agentscope_bus::auth::{self, AccountKey, AuthRequest};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub(crate) async fn serve(
    ctx: Ctx,
    issuer: Arc<AccountKey>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    // Every replica answers; the queue group hands each request to one of them.
    let at = Endpoint {
        subject: auth::CALLOUT_SUBJECT,
        queue_group: "scheduler-callout",
        concurrency: 32,
    };
    // The request is a JWT, not a protobuf message; an unreadable one is left unanswered.
    agentscope_bus::serve_raw(&ctx.nats, at, cancel, |msg| {
        let ctx = ctx.clone();
        let issuer = issuer.clone();
        async move {
            let req = match AuthRequest::parse(&msg.payload) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "unreadable NATS authorization request");
                    return None;
                }
            };
            let answer = match decide(&ctx, &req).await {
                Ok(Ok((name, perms))) => {
                    ctx.metrics
                        .inc("agentscope_nats_connections_authorized_total", &[]);
                    auth::authorization_response(&issuer, &req, Ok((&name, perms)))
                }
                Ok(Err(reason)) => {
                    ctx.metrics
                        .inc("agentscope_nats_connections_refused_total", &[]);
                    tracing::warn!(user = %req.user, reason, "NATS connection refused");
                    auth::authorization_response(&issuer, &req, Err(reason))
                }
                Err(e) => {
                    tracing::warn!(error = ?e, user = %req.user, "NATS authorization could not be checked");
                    auth::authorization_response(
                        &issuer,
                        &req,
                        Err("the credential could not be checked; retry"),
                    )
                }
            };
            Some(answer.into())
        }
    })
    .await
    .map_err(Error::bus)?;
    Ok(())
}

type Decision = Result<(String, auth::Permissions), &'static str>;

async fn decide(ctx: &Ctx, req: &AuthRequest) -> Result<Decision, Error> {
    let kind = if req.password.starts_with("agh_") {
        "host"
    } else if req.password.starts_with("agw_") {
        "worker"
    } else {
        return Ok(Err("unknown credential"));
    };
    let found = sqlx::query_scalar!(
        "SELECT workspace_id FROM api_tokens WHERE token_hash = $1 AND kind = $2 AND revoked_at IS NULL",
        agentscope_domain::hash_token(&req.password),
        kind,
    )
    .fetch_optional(&ctx.db)
    .await?;
    let Some(workspace_id) = found else {
        return Ok(Err("unknown or revoked token"));
    };
    if kind == "worker" {
        let valid = !req.user.is_empty()
            && req.user.len() <= 200
            && !req.user.chars().any(|c| c.is_control());
        if !valid {
            return Ok(Err("the worker name must be 1 to 200 printable characters"));
        }
        let id = agentscope_domain::worker_id(&workspace_id.to_string(), &req.user);
        return Ok(Ok((
            format!("worker:{id}"),
            auth::worker_permissions(&id, &req.password),
        )));
    }
    let Ok(host_id) = Uuid::parse_str(&req.user) else {
        return Ok(Err("a host connects with its host id (a UUID) as the user"));
    };
    // A host id belongs to the workspace that first registered it.
    let owner = sqlx::query_scalar!("SELECT workspace_id FROM hosts WHERE id = $1", host_id)
        .fetch_optional(&ctx.db)
        .await?;
    if owner.is_some_and(|w| w != workspace_id) {
        return Ok(Err("this host id is registered in another workspace"));
    }
    Ok(Ok((
        format!("host:{host_id}"),
        auth::host_permissions(&workspace_id.to_string(), &host_id.to_string()),
    )))
}
