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

/// The events one message on an events subject carries: an `ExecutionEventBatch`, or one
/// `ExecutionEvent` (the batch's field number is one no `ExecutionEvent` uses, so an event
/// decodes as an empty batch and a batch as an event without a body).
pub fn decode_events(bytes: &[u8]) -> Result<Vec<v1::ExecutionEvent>, DecodeError> {
    match v1::ExecutionEventBatch::decode(bytes) {
        Ok(b) if !b.events.is_empty() => Ok(b.events),
        _ => decode::<v1::ExecutionEvent>(bytes).map(|e| vec![e]),
    }
}

/// An `ExecutionEventBatch` of events each already encoded (`ExecutionEvent::encode_to_vec`):
/// the batch's wire form is their concatenation, each behind its field's tag and length.
pub fn encode_batch<'a>(events: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    const EVENTS_FIELD: u32 = 30;
    let mut out = Vec::new();
    for e in events {
        prost::encoding::encode_key(
            EVENTS_FIELD,
            prost::encoding::WireType::LengthDelimited,
            &mut out,
        );
        prost::encoding::encode_varint(e.len() as u64, &mut out);
        out.extend_from_slice(e);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use v1::{Diagnostic, ExecutionEvent, execution_event::Body};

    fn event(seq: u64) -> ExecutionEvent {
        ExecutionEvent {
            attempt_id: "a".into(),
            seq,
            lease_token: 7,
            host_id: "h".into(),
            at_ms: 1,
            body: Some(Body::Diagnostic(Diagnostic {
                level: "info".into(),
                code: "c".into(),
                message: format!("line {seq}"),
            })),
        }
    }

    #[test]
    fn one_event_and_a_batch_decode_as_what_they_carry() {
        let one = event(1).encode_to_vec();
        assert_eq!(decode_events(&one).unwrap(), vec![event(1)]);
        let encoded: Vec<Vec<u8>> = (1..=3).map(|s| event(s).encode_to_vec()).collect();
        let batch = encode_batch(encoded.iter().map(|e| e.as_slice()));
        assert_eq!(
            batch,
            v1::ExecutionEventBatch {
                events: (1..=3).map(event).collect()
            }
            .encode_to_vec()
        );
        assert_eq!(
            decode_events(&batch).unwrap(),
            (1..=3).map(event).collect::<Vec<_>>()
        );
    }

    #[test]
    fn garbage_is_a_decode_error_and_nothing_is_an_event_without_a_body() {
        assert!(decode_events(&[0xff, 0xff, 0xff]).is_err());
        let empty = decode_events(&[]).unwrap();
        assert_eq!(empty.len(), 1);
        assert!(empty[0].body.is_none());
    }
}
