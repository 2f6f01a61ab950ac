//! The two loops every service used to write by hand: answering requests on a subject (core
//! NATS request/reply; a queue group hands each request to one replica) and consuming a
//! JetStream pull consumer (each message settled once its handler is done, so a handler that
//! commits before it returns acknowledges only what is stored).
//!
//! Payloads are the protobuf messages of `agentscope_schemas`; one that does not decode takes the
//! malformed path: a warning naming the subject and the message type, then what the caller
//! decides (a refusal for a request, a terminate or a redelivery for a stream message).

use agentscope_schemas::{DecodeError, Message as Proto};
use async_nats::jetstream::{self, AckKind};
use async_nats::{Client, Subject, SubscribeError};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use std::future::Future;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Where a request/reply service listens and how many requests it handles at once.
#[derive(Debug, Clone, Copy)]
pub struct Endpoint<'a> {
    pub subject: &'a str,
    pub queue_group: &'a str,
    /// Requests handled at once; 1 handles them one after another, in arrival order.
    pub concurrency: usize,
}

/// One request: its subject (which names, for instance, the host NATS let publish it) and its
/// payload decoded, or why it does not decode.
#[derive(Debug)]
pub struct Request<T> {
    pub subject: Subject,
    pub body: Result<T, DecodeError>,
}

/// Answers requests on `at` until `stop` fires or the subscription ends; requests in hand are
/// answered first. `handler` gets every request that asks for a reply (others are dropped
/// unhandled) and returns the reply's payload, or None to leave it unanswered.
pub async fn serve_raw<H, Fut>(
    client: &Client,
    at: Endpoint<'_>,
    stop: CancellationToken,
    handler: H,
) -> Result<(), SubscribeError>
where
    H: Fn(async_nats::Message) -> Fut,
    Fut: Future<Output = Option<Bytes>>,
{
    let sub = client
        .queue_subscribe(at.subject.to_string(), at.queue_group.to_string())
        .await?;
    let handler = &handler;
    sub.take_until(stop.cancelled_owned())
        .for_each_concurrent(at.concurrency.max(1), |msg| async move {
            let Some(reply) = msg.reply.clone() else {
                return;
            };
            if let Some(answer) = handler(msg).await
                && let Err(e) = client.publish(reply, answer).await
            {
                tracing::debug!(error = %e, "publish a reply");
            }
        })
        .await;
    Ok(())
}

/// [`serve_raw`] with protobuf messages: each request is decoded as `Req` (a payload that does
/// not decode is logged and handed to `handler` as its error, which answers it with a refusal)
/// and `handler`'s `Resp` is the reply.
pub async fn serve<Req, Resp, H, Fut>(
    client: &Client,
    at: Endpoint<'_>,
    stop: CancellationToken,
    handler: H,
) -> Result<(), SubscribeError>
where
    Req: Proto + Default,
    Resp: Proto,
    H: Fn(Request<Req>) -> Fut,
    Fut: Future<Output = Resp>,
{
    serve_raw(client, at, stop, |msg| {
        let body = agentscope_schemas::decode::<Req>(&msg.payload);
        if let Err(e) = &body {
            tracing::warn!(subject = %msg.subject, error = %e, "request refused: it does not decode");
        }
        let answer = handler(Request {
            subject: msg.subject,
            body,
        });
        async move { Some(Bytes::from(answer.await.encode_to_vec())) }
    })
    .await
}

/// How a stream consumer is named in logs and how many messages it handles at once.
#[derive(Debug, Clone, Copy)]
pub struct Consume<'a> {
    pub name: &'a str,
    /// Messages handled at once; 1 handles them one after another, in delivery order.
    pub concurrency: usize,
}

/// Handles the messages of a JetStream pull consumer until `stop` fires or the stream ends;
/// messages in hand are handled and settled first. `handler` returns how its message is
/// settled (`Ack` once what it did is committed, `Nak` with a delay to have it redelivered,
/// `Term` to give up on it), and the message is acknowledged so after the handler returns. An
/// error from the stream itself is logged and the loop goes on (the client reconnects).
pub async fn consume<S, E, H, Fut>(
    messages: S,
    how: Consume<'_>,
    stop: CancellationToken,
    handler: H,
) where
    S: Stream<Item = Result<jetstream::Message, E>>,
    E: std::fmt::Debug,
    H: Fn(Arc<jetstream::Message>) -> Fut,
    Fut: Future<Output = AckKind>,
{
    let handler = &handler;
    let name = how.name;
    messages
        .take_until(stop.cancelled_owned())
        .for_each_concurrent(how.concurrency.max(1), |msg| async move {
            let msg = match msg {
                Ok(m) => Arc::new(m),
                Err(e) => {
                    tracing::warn!(consumer = name, error = ?e, "stream consumer");
                    return;
                }
            };
            let ack = handler(msg.clone()).await;
            if let Err(e) = msg.ack_with(ack).await {
                tracing::warn!(consumer = name, error = ?e, "acknowledge a stream message");
            }
        })
        .await;
}

/// [`consume`] with protobuf messages: each payload is decoded as `T` and handed to `handler`;
/// one that does not decode is logged and handed to `malformed` instead, which says how it is
/// settled (usually recorded and terminated: it would fail the same way on every redelivery).
pub async fn consume_decoded<T, S, E, H, Fut, M, MFut>(
    messages: S,
    how: Consume<'_>,
    stop: CancellationToken,
    handler: H,
    malformed: M,
) where
    T: Proto + Default,
    S: Stream<Item = Result<jetstream::Message, E>>,
    E: std::fmt::Debug,
    H: Fn(Arc<jetstream::Message>, T) -> Fut,
    Fut: Future<Output = AckKind>,
    M: Fn(Arc<jetstream::Message>, DecodeError) -> MFut,
    MFut: Future<Output = AckKind>,
{
    let (handler, malformed) = (&handler, &malformed);
    let name = how.name;
    consume(messages, how, stop, |msg| async move {
        match agentscope_schemas::decode::<T>(&msg.payload) {
            Ok(body) => handler(msg, body).await,
            Err(e) => {
                tracing::warn!(consumer = name, subject = %msg.subject, error = %e, "stream message does not decode");
                malformed(msg, e).await
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentscope_schemas::v1::{HostRegistered, HostRegistration, ToolRequest};
    use agentscope_testkit as kit;
    use async_nats::jetstream::consumer::{AckPolicy, pull};
    use std::sync::Mutex;
    use std::time::Duration;

    async fn nats() -> (kit::TempDir, kit::Nats, Client) {
        let dir = kit::TempDir::new("bus-loops");
        let server = kit::Nats::start_open(&dir.path).await.expect("nats-server");
        let client = async_nats::connect(server.url()).await.expect("connect");
        (dir, server, client)
    }

    fn reply(ok: bool, message: &str) -> HostRegistered {
        HostRegistered {
            ok,
            message: message.into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn serve_answers_typed_requests_and_refuses_what_does_not_decode() {
        let (_dir, _server, client) = nats().await;
        let stop = CancellationToken::new();
        let at = Endpoint {
            subject: "test.register.*",
            queue_group: "q",
            concurrency: 4,
        };
        let server = {
            let (client, stop) = (client.clone(), stop.clone());
            tokio::spawn(async move {
                serve(
                    &client,
                    at,
                    stop,
                    |req: Request<HostRegistration>| async move {
                        match req.body {
                            Ok(r) => reply(true, &format!("{} on {}", r.name, req.subject)),
                            Err(e) => reply(false, &e.to_string()),
                        }
                    },
                )
                .await
            })
        };
        client.flush().await.unwrap();
        let ask = |subject: &'static str, payload: Vec<u8>| {
            let client = client.clone();
            async move {
                let m = kit::wait_for("a reply", Duration::from_secs(10), || {
                    let (client, payload) = (client.clone(), payload.clone());
                    async move { client.request(subject, payload.into()).await.ok() }
                })
                .await
                .unwrap();
                HostRegistered::decode(m.payload.as_ref()).unwrap()
            }
        };
        let reg = HostRegistration {
            name: "h1".into(),
            ..Default::default()
        };
        let ok = ask("test.register.a", reg.encode_to_vec()).await;
        assert!(ok.ok);
        assert_eq!(ok.message, "h1 on test.register.a");
        let bad = ask("test.register.b", vec![0xff, 0xff, 0xff]).await;
        assert!(!bad.ok);
        assert_eq!(bad.message, "malformed HostRegistration payload");

        stop.cancel();
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("serve returns once stopped")
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn consume_settles_each_message_as_its_handler_says() {
        let (_dir, _server, client) = nats().await;
        let js = jetstream::new(client.clone());
        let stream = js
            .get_or_create_stream(jetstream::stream::Config {
                name: "LOOPS".into(),
                subjects: vec!["loops.>".into()],
                ..Default::default()
            })
            .await
            .unwrap();
        let consumer = stream
            .create_consumer(pull::Config {
                durable_name: Some("loops".into()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                ..Default::default()
            })
            .await
            .unwrap();
        let req = |id: &str| {
            ToolRequest {
                request_id: id.into(),
                ..Default::default()
            }
            .encode_to_vec()
        };
        // "again" is refused on its first delivery and redelivered; "junk" does not decode.
        for (subject, payload) in [
            ("loops.a", req("first")),
            ("loops.b", req("again")),
            ("loops.c", b"\xff\xff\xff".to_vec()),
            ("loops.d", req("last")),
        ] {
            js.publish(subject, payload.into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
        let seen = Arc::new(Mutex::new(Vec::<String>::new()));
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        let stop = CancellationToken::new();
        let messages = consumer.messages().await.unwrap();
        let run = {
            let (seen, stop) = (seen.clone(), stop.clone());
            tokio::spawn(async move {
                let (s2, d2) = (seen.clone(), done_tx.clone());
                consume_decoded(
                    messages,
                    Consume {
                        name: "loops",
                        concurrency: 1,
                    },
                    stop,
                    move |msg, req: ToolRequest| {
                        let (seen, done) = (seen.clone(), done_tx.clone());
                        async move {
                            let delivered = msg.info().unwrap().delivered;
                            seen.lock()
                                .unwrap()
                                .push(format!("{}#{delivered}", req.request_id));
                            let _ = done.send(());
                            if req.request_id == "again" && delivered == 1 {
                                AckKind::Nak(Some(Duration::from_millis(50)))
                            } else {
                                AckKind::Ack
                            }
                        }
                    },
                    move |msg, e| {
                        let (seen, done) = (s2.clone(), d2.clone());
                        async move {
                            seen.lock().unwrap().push(format!("{}: {e}", msg.subject));
                            let _ = done.send(());
                            AckKind::Term
                        }
                    },
                )
                .await
            })
        };
        for _ in 0..5 {
            tokio::time::timeout(Duration::from_secs(20), done_rx.recv())
                .await
                .expect("every delivery handled")
                .unwrap();
        }
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("consume returns once stopped")
            .unwrap();
        let mut seen = seen.lock().unwrap().clone();
        seen.sort();
        assert_eq!(
            seen,
            [
                "again#1",
                "again#2",
                "first#1",
                "last#1",
                "loops.c: malformed ToolRequest payload"
            ]
        );
        // Everything was settled: nothing is pending or waiting for redelivery.
        client.flush().await.unwrap();
        kit::wait_for("every message settled", Duration::from_secs(10), || {
            let mut consumer = consumer.clone();
            async move {
                let info = consumer.info().await.ok()?;
                (info.num_ack_pending == 0 && info.num_pending == 0).then_some(())
            }
        })
        .await
        .unwrap();
    }
}
