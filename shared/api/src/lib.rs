//! The HTTP API's types: what each `/v1` route accepts (request bodies, refused with
//! `422 invalid_field` when a field is unknown or mistyped, and query parameters) and what it
//! answers (response bodies and the error body with its stable codes). The gateway serves them,
//! its OpenAPI document (`/v1/openapi.json`) is generated from them, and clients (the CLI, the
//! tests) can read responses into them instead of indexing JSON by hand.
//!
//! Light on purpose: serde, uuid, chrono and utoipa's derive only; no HTTP or database types.
//! [`sse`] reads the gateway's event streams back.

pub mod error;
pub mod requests;
pub mod responses;
pub mod sse;

pub use error::{ErrorBody, ErrorDetail, codes};
pub use requests::*;
pub use responses::*;

/// The schemas one type contributes to a document: its own, named, and those of every type it
/// refers to.
pub type Schemas = Vec<(
    String,
    utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
)>;

/// Adds `T`'s schema (and those it refers to) to `out` and returns a `$ref` to it, as JSON.
pub fn schema_ref<T: utoipa::ToSchema>(out: &mut Schemas) -> serde_json::Value {
    let name = T::name().into_owned();
    out.push((name.clone(), T::schema()));
    T::schemas(out);
    serde_json::json!({ "$ref": format!("#/components/schemas/{name}") })
}

/// `T`'s query parameters as OpenAPI parameter objects, as JSON.
pub fn query_params<T: utoipa::IntoParams>() -> Vec<serde_json::Value> {
    T::into_params(|| Some(utoipa::openapi::path::ParameterIn::Query))
        .into_iter()
        .map(|p| serde_json::to_value(p).expect("a parameter serializes"))
        .collect()
}
