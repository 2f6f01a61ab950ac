//! The wire contracts: every message on the bus is one of these protobuf messages.
//! This crate is the only place that knows protobuf; services convert at the edge.

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/agentscope.v1.rs"));
}

pub use prost::Message;

/// Decode a bus payload; the error names the message type.
pub fn decode<M: prost::Message + Default>(bytes: &[u8]) -> Result<M, DecodeError> {
    M::decode(bytes).map_err(|source| DecodeError {
        message: std::any::type_name::<M>()
            .rsplit("::")
            .next()
            .unwrap_or("message"),
        source,
    })
}

#[derive(Debug)]
pub struct DecodeError {
    pub message: &'static str,
    pub source: prost::DecodeError,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed {} payload", self.message)
    }
}

impl std::error::Error for DecodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}
