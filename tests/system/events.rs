//! Events at volume: many live followers of one busy task, resuming with `Last-Event-ID`, and
//! the recorder's batches with a fenced or malformed message among good ones.

use agentscope_schemas::Message;
use agentscope_schemas::v1::{ExecutionEvent, Output, execution_event::Body};
use agentscope_system_tests::*;
use serde_json::json;
use std::time::Duration;

/// The gateway's count of SSE streams opened so far.
async fn sse_streams(api: &Api) -> Option<u64> {
    metric(&api.base, "agentscope_sse_streams_total")
        .await
        .map(|v| v as u64)
}

/// The ids (`number:seq`) of a task's events in the database, in order.
async fn stored_ids(stack: &Stack, task_id: &str) -> Vec<String> {
    let rows: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT a.number, e.seq FROM execution_events e JOIN attempts a ON a.id = e.attempt_id
         WHERE a.task_id = $1::uuid ORDER BY a.number, e.seq",
    )
    .bind(task_id)
    .fetch_all(&stack.pg)
    .await
    .unwrap();
    rows.into_iter().map(|(n, s)| format!("{n}:{s}")).collect()
}

/// A task whose command waits for `gate`, prints `lines` numbered lines, and succeeds.
async fn gated_task(stack: &Stack, gate: &std::path::Path, lines: u32) -> String {
    let script = format!(
        "echo ready; while [ ! -e '{}' ]; do sleep 0.02; done; seq 1 {lines}",
        gate.display()
    );
    let (agent, _) = stack
        .command_agent("busy", "pool", &["sh", "-c", &script], None)
        .await
        .unwrap();
    stack.submit(json!({"agent_id": agent})).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_followers_of_a_busy_task_each_get_every_event_once_in_order() {
    const FOLLOWERS: usize = 20;
    const LINES: u32 = 3000;
    let stack = Stack::start("followers", StackOptions::default())
        .await
        .unwrap();
    let gate = stack.dir.path.join("gate");
    let task_id = gated_task(&stack, &gate, LINES).await;
    let (_host, _) = stack.host("h", "pool", 1).await.unwrap();
    stack
        .wait_attempt(&task_id, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();

    let before = sse_streams(&stack.api).await.unwrap();
    let path = format!("/v1/tasks/{task_id}/events");
    let mut followers = Vec::new();
    for _ in 0..FOLLOWERS {
        let (api, path) = (stack.api.clone(), path.clone());
        followers.push(tokio::spawn(async move {
            sse_collect(&api, &path, None, None, Duration::from_secs(180)).await
        }));
    }
    // Every follower is attached (the shared feed serves them) before the output starts.
    let api = stack.api.clone();
    kit::wait_for("the followers to attach", Duration::from_secs(30), || {
        let api = api.clone();
        async move { (sse_streams(&api).await? >= before + FOLLOWERS as u64).then_some(()) }
    })
    .await
    .unwrap();
    std::fs::write(&gate, "go").unwrap();

    // Late followers join while the lines flow, from the middle (Last-Event-ID) and the start.
    let pg = stack.pg.clone();
    let tid = task_id.clone();
    let middle: (i32, i64) = kit::wait_for("some lines recorded", Duration::from_secs(60), || {
        let (pg, tid) = (pg.clone(), tid.clone());
        async move {
            let r: Option<(i32, i64)> = sqlx::query_as(
                "SELECT number, last_seq FROM attempts WHERE task_id = $1::uuid AND last_seq >= 100 ORDER BY number DESC LIMIT 1",
            )
            .bind(tid)
            .fetch_optional(&pg)
            .await
            .ok()?;
            r
        }
    })
    .await
    .unwrap();
    let from = format!("{}:{}", middle.0, middle.1);
    let mut late = Vec::new();
    for i in 0..4 {
        let (api, path, from) = (stack.api.clone(), path.clone(), from.clone());
        late.push(tokio::spawn(async move {
            let last = (i % 2 == 0).then_some(from);
            sse_collect(&api, &path, last.as_deref(), None, Duration::from_secs(180)).await
        }));
    }

    stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(180))
        .await
        .unwrap();
    let all = stored_ids(&stack, &task_id).await;
    assert!(all.len() > LINES as usize, "{} events", all.len());
    // A busy attempt's events travel in batches: fewer messages than events in the stream.
    let attempt_id: String =
        sqlx::query_scalar("SELECT id::text FROM attempts WHERE task_id = $1::uuid")
            .bind(&task_id)
            .fetch_one(&stack.pg)
            .await
            .unwrap();
    let js = async_nats::jetstream::new(stack.nats.service_client("scheduler").await.unwrap());
    let mut per_subject = js
        .get_stream(agentscope_bus::STREAM_EVENTS)
        .await
        .unwrap()
        .info_with_subjects(format!("agentscope.events.*.{attempt_id}"))
        .await
        .unwrap();
    let mut messages = 0;
    while let Some(s) = futures::StreamExt::next(&mut per_subject).await {
        messages += s.unwrap().1;
    }
    assert!(
        messages > 0 && messages < all.len(),
        "{messages} messages for {} events",
        all.len()
    );
    for f in followers {
        let got = f.await.unwrap().unwrap();
        let (end, data) = got.split_last().unwrap();
        assert_eq!(end.event, "end", "the stream ends with the task");
        assert!(end.data.contains("succeeded"), "{}", end.data);
        let ids: Vec<String> = data.iter().map(|e| e.id.clone()).collect();
        assert_eq!(ids.len(), all.len(), "every event once");
        assert_eq!(ids, all, "every event once, in order");
        let lines: Vec<String> = data
            .iter()
            .filter(|e| e.event == "output")
            .map(|e| {
                serde_json::from_str::<serde_json::Value>(&e.data).unwrap()["payload"]["text"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .filter(|t| t.parse::<u32>().is_ok())
            .collect();
        let expected: Vec<String> = (1..=LINES).map(|i| i.to_string()).collect();
        assert_eq!(lines, expected, "one event per line, in order");
    }
    let pos = all.iter().position(|i| *i == from).unwrap();
    for (i, f) in late.into_iter().enumerate() {
        let got = f.await.unwrap().unwrap();
        let (end, data) = got.split_last().unwrap();
        assert_eq!(end.event, "end");
        let ids: Vec<String> = data.iter().map(|e| e.id.clone()).collect();
        let want = if i % 2 == 0 {
            &all[pos + 1..]
        } else {
            &all[..]
        };
        assert_eq!(ids, want, "late follower {i}");
    }
}

/// The gateway's count of live pages its shared readers sent, by where they came from
/// (`notice`: the recorder's commit notice carried the rows; `database`: read back).
async fn live_pages(api: &Api, from: &str) -> f64 {
    metric(
        &api.base,
        &format!("agentscope_sse_pages_total{{from=\"{from}\"}}"),
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_followers_get_events_from_the_commit_notices_exactly_as_stored() {
    let stack = Stack::start("notice-pages", StackOptions::default())
        .await
        .unwrap();
    let gate = stack.dir.path.join("gate");
    // Lines a few milliseconds apart (each commit brings one or two), with quotes, backslashes,
    // tabs, non-ASCII text and a NUL (stored as U+FFFD) in them.
    let script = format!(
        "echo ready; while [ ! -e '{}' ]; do sleep 0.02; done; i=0; \
         while [ $i -lt 60 ]; do i=$((i+1)); printf 'line %s \"q\" \\\\ \\t é 😀 {{\"k\": [1]}}\\n' $i; sleep 0.005; done; \
         printf 'nul\\000byte\\n'",
        gate.display()
    );
    let (agent, _) = stack
        .command_agent("tricky", "pool", &["sh", "-c", &script], None)
        .await
        .unwrap();
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    // Another task printing the same lines at the same time: its commits' notices travel beside
    // the first one's, and neither task's followers may get the other's.
    let other_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let (_host, _) = stack.host("h", "pool", 2).await.unwrap();
    for t in [&task_id, &other_id] {
        stack
            .wait_attempt(t, 1, "running", Duration::from_secs(30))
            .await
            .unwrap();
    }
    let attempt_id: String =
        sqlx::query_scalar("SELECT id::text FROM attempts WHERE task_id = $1::uuid")
            .bind(&task_id)
            .fetch_one(&stack.pg)
            .await
            .unwrap();

    // Two followers of the task, one of its attempt and one of the other task (three scopes,
    // three shared readers).
    let before = sse_streams(&stack.api).await.unwrap();
    let from_notices = live_pages(&stack.api, "notice").await;
    let paths = [
        format!("/v1/tasks/{task_id}/events"),
        format!("/v1/tasks/{task_id}/events"),
        format!("/v1/attempts/{attempt_id}/events"),
        format!("/v1/tasks/{other_id}/events"),
    ];
    let mut followers = Vec::new();
    for path in &paths {
        let (api, path) = (stack.api.clone(), path.clone());
        followers.push(tokio::spawn(async move {
            sse_collect(&api, &path, None, None, Duration::from_secs(120)).await
        }));
    }
    let (api, attached) = (stack.api.clone(), before + paths.len() as u64);
    kit::wait_for("the followers to attach", Duration::from_secs(30), || {
        let api = api.clone();
        async move { (sse_streams(&api).await? >= attached).then_some(()) }
    })
    .await
    .unwrap();
    std::fs::write(&gate, "go").unwrap();
    for t in [&task_id, &other_id] {
        stack
            .wait_task(t, "succeeded", Duration::from_secs(60))
            .await
            .unwrap();
    }

    for (path, f) in paths.iter().zip(followers) {
        let got = f.await.unwrap().unwrap();
        let (end, live) = got.split_last().unwrap();
        assert_eq!(end.event, "end", "{path}");
        // The same scope read as a page after the end: each live event's frame is the stored
        // event, byte for byte as a page renders it (so none of the other task's).
        let page = stack.api.get(&format!("{path}?limit=5000")).await.unwrap();
        let stored = page["items"].as_array().unwrap();
        assert_eq!(live.len(), stored.len(), "{path}: every event once");
        for (e, row) in live.iter().zip(stored) {
            assert_eq!(e.id, row["id"].as_str().unwrap(), "{path}");
            assert_eq!(e.event, row["kind"].as_str().unwrap(), "{path}");
            assert_eq!(e.data, row.to_string(), "{path}");
        }
        let texts: Vec<&str> = stored
            .iter()
            .filter_map(|r| r["payload"]["text"].as_str())
            .collect();
        assert!(
            texts.contains(&"line 60 \"q\" \\ \t é 😀 {\"k\": [1]}"),
            "{texts:?}"
        );
        assert!(texts.contains(&"nul\u{fffd}byte"), "{texts:?}");
    }
    // The followers' live pages came from the notices, not from reading them back.
    let carried = live_pages(&stack.api, "notice").await - from_notices;
    assert!(carried >= 10.0, "{carried} live pages from notices");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_reconnects_with_last_event_id_gets_the_rest() {
    let stack = Stack::start("resume-sse", StackOptions::default())
        .await
        .unwrap();
    let (gate1, gate2) = (stack.dir.path.join("gate1"), stack.dir.path.join("gate2"));
    let script = format!(
        "seq 1 500; while [ ! -e '{}' ]; do sleep 0.02; done; seq 501 1000; while [ ! -e '{}' ]; do sleep 0.02; done; seq 1001 1500",
        gate1.display(),
        gate2.display()
    );
    let (agent, _) = stack
        .command_agent("resumer", "pool", &["sh", "-c", &script], None)
        .await
        .unwrap();
    let (_host, _) = stack.host("h", "pool", 1).await.unwrap();
    let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
    let path = format!("/v1/tasks/{task_id}/events");

    // The first part, while the task still runs; the connection then goes away.
    let first = sse_collect(&stack.api, &path, None, Some(300), Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(first.len(), 300);
    let last = first.last().unwrap().id.clone();
    // Events keep coming while the client is away.
    std::fs::write(&gate1, "go").unwrap();
    let pg = stack.pg.clone();
    let tid = task_id.clone();
    kit::wait_for("lines 501.. recorded", Duration::from_secs(60), || {
        let (pg, tid) = (pg.clone(), tid.clone());
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT last_seq FROM attempts WHERE task_id = $1::uuid AND number = 1",
            )
            .bind(tid)
            .fetch_one(&pg)
            .await
            .ok()?;
            (n > 1000).then_some(())
        }
    })
    .await
    .unwrap();
    // Reconnect with the last id seen; the rest arrives live as well.
    let (api, p, l) = (stack.api.clone(), path.clone(), last.clone());
    let rest = tokio::spawn(async move {
        sse_collect(&api, &p, Some(&l), None, Duration::from_secs(120)).await
    });
    std::fs::write(&gate2, "go").unwrap();
    let rest = rest.await.unwrap().unwrap();
    stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    let (end, rest) = rest.split_last().unwrap();
    assert_eq!(end.event, "end");
    let ids: Vec<String> = first.iter().chain(rest).map(|e| e.id.clone()).collect();
    assert_eq!(ids, stored_ids(&stack, &task_id).await, "no gap, no repeat");
}

/// A running attempt that stays quiet (its command waits for a gate that never opens) once its
/// "ready" line is recorded, so a test can write its next events itself.
struct Quiet {
    task_id: String,
    attempt_id: String,
    host: String,
    token: i64,
    /// The attempt's `last_seq` after its "ready" line.
    last: i64,
    subject: String,
    _host: kit::Proc,
}

impl Quiet {
    async fn start(stack: &Stack) -> Quiet {
        let gate = stack.dir.path.join("never");
        let task_id = gated_task(stack, &gate, 1).await;
        let (host_child, _) = stack.host("h", "pool", 1).await.unwrap();
        let attempt = stack
            .wait_attempt(&task_id, 1, "running", Duration::from_secs(30))
            .await
            .unwrap();
        let attempt_id = attempt["id"].as_str().unwrap().to_string();
        let pg = stack.pg.clone();
        let aid = attempt_id.clone();
        let (host_id, token, last): (uuid::Uuid, i64, i64) =
            kit::wait_for("the ready line", Duration::from_secs(30), || {
                let (pg, aid) = (pg.clone(), aid.clone());
                async move {
                    let ready: bool = sqlx::query_scalar(
                        "SELECT EXISTS (SELECT 1 FROM execution_events WHERE attempt_id = $1::uuid AND payload->>'text' = 'ready')",
                    )
                    .bind(&aid)
                    .fetch_one(&pg)
                    .await
                    .ok()?;
                    if !ready {
                        return None;
                    }
                    sqlx::query_as(
                        "SELECT host_id, lease_token, last_seq FROM attempts WHERE id = $1::uuid",
                    )
                    .bind(&aid)
                    .fetch_one(&pg)
                    .await
                    .ok()
                }
            })
            .await
            .unwrap();
        let host = host_id.to_string();
        let subject = agentscope_bus::subjects::events(&host, &attempt_id);
        Quiet {
            task_id,
            attempt_id,
            host,
            token,
            last,
            subject,
            _host: host_child,
        }
    }

    /// An output event of the attempt, encoded.
    fn event(&self, seq: i64, token: i64, text: &str) -> Vec<u8> {
        ExecutionEvent {
            attempt_id: self.attempt_id.clone(),
            seq: seq as u64,
            lease_token: token as u64,
            host_id: self.host.clone(),
            at_ms: agentscope_bus::now_ms(),
            body: Some(Body::Output(Output {
                stream: "stdout".into(),
                text: text.into(),
                truncated: false,
            })),
        }
        .encode_to_vec()
    }

    /// The attempt's stored output after its "ready" line: (seq, text).
    async fn texts(&self, stack: &Stack) -> Vec<(i64, String)> {
        sqlx::query_as(
            "SELECT seq, payload->>'text' FROM execution_events WHERE attempt_id = $1::uuid AND seq > $2 ORDER BY seq",
        )
        .bind(&self.attempt_id)
        .bind(self.last)
        .fetch_all(&stack.pg)
        .await
        .unwrap()
    }

    /// The recorder's rejections of the attempt's events, by reason.
    async fn rejected(&self, stack: &Stack) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT reason FROM rejected_messages WHERE consumer = 'recorder' AND subject = $1 ORDER BY reason",
        )
        .bind(&self.subject)
        .fetch_all(&stack.pg)
        .await
        .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_a_fenced_event_in_the_middle_records_the_good_ones_and_rejects_the_bad() {
    let mut stack = Stack::start("batch", StackOptions::default())
        .await
        .unwrap();
    let q = Quiet::start(&stack).await;
    let (subject, token, last) = (q.subject.clone(), q.token, q.last);
    let event = |seq: i64, token: i64, text: &str| q.event(seq, token, text);
    let several =
        |events: &[Vec<u8>]| agentscope_schemas::encode_batch(events.iter().map(|e| e.as_slice()));
    let batch: Vec<Vec<u8>> = vec![
        event(last + 1, token, "good-1"),
        event(last + 2, token, "good-2"),
        // A stale holder's event, a message that is no event, and a repeat, among good ones.
        event(last + 3, token + 1000, "fenced"),
        b"not an event".to_vec(),
        event(last + 3, token, "good-3"),
        event(last + 2, token, "good-2"),
        // Messages of several events: one ahead of its time (recorded once the gap is filled)
        // and one that repeats an event and adds the missing one.
        several(&[
            event(last + 5, token, "good-5"),
            event(last + 6, token, "good-6"),
        ]),
        several(&[
            event(last + 3, token, "good-3"),
            event(last + 4, token, "good-4"),
        ]),
    ];

    // Published while no scheduler runs, so the recorder finds them together.
    stack.scheduler.terminate(Duration::from_secs(20));
    let js = async_nats::jetstream::new(stack.nats.service_client("scheduler").await.unwrap());
    for payload in batch {
        js.publish(subject.clone(), payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    stack.restart_scheduler(false).await.unwrap();

    let texts = kit::wait_for(
        "the good events recorded",
        Duration::from_secs(30),
        || async {
            let rows = q.texts(&stack).await;
            (rows.len() >= 6).then_some(rows)
        },
    )
    .await
    .unwrap();
    assert_eq!(
        texts,
        (1..=6)
            .map(|i| (last + i, format!("good-{i}")))
            .collect::<Vec<_>>()
    );
    let reasons = kit::wait_for("the bad ones rejected", Duration::from_secs(30), || async {
        let r = q.rejected(&stack).await;
        (r.len() >= 2).then_some(r)
    })
    .await
    .unwrap();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons.iter().any(|r| r.starts_with("fenced")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("malformed")),
        "{reasons:?}"
    );
    let (status, last_seq): (String, i64) =
        sqlx::query_as("SELECT status, last_seq FROM attempts WHERE id = $1::uuid")
            .bind(&q.attempt_id)
            .fetch_one(&stack.pg)
            .await
            .unwrap();
    assert_eq!((status.as_str(), last_seq), ("running", last + 6));
}

/// The attempt's `last_seq` and its newest stored event, and how many events it has.
async fn seqs(stack: &Stack, task_id: &str) -> (i64, Option<i64>, i64) {
    sqlx::query_as(
        "SELECT a.last_seq, max(e.seq), count(e.seq) FROM attempts a
         LEFT JOIN execution_events e ON e.attempt_id = a.id
         WHERE a.task_id = $1::uuid GROUP BY a.id, a.last_seq",
    )
    .bind(task_id)
    .fetch_one(&stack.pg)
    .await
    .unwrap()
}

/// Every batch the recorder commits leaves the attempt's `last_seq` at its newest stored event:
/// the batch that moves it to `running` (which sets `last_seq` in the same update) and the one
/// that ends it (likewise), as well as those in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_recorded_batch_leaves_last_seq_at_the_newest_event() {
    let stack = Stack::start("last-seq", StackOptions::default())
        .await
        .unwrap();
    let gate = stack.dir.path.join("gate");
    let task_id = gated_task(&stack, &gate, 50).await;
    let (_host, _) = stack.host("h", "pool", 1).await.unwrap();
    stack
        .wait_attempt(&task_id, 1, "running", Duration::from_secs(30))
        .await
        .unwrap();
    // Running, and waiting for the gate with its first line printed.
    let pg = stack.pg.clone();
    let tid = task_id.clone();
    kit::wait_for("the first line recorded", Duration::from_secs(30), || {
        let (pg, tid) = (pg.clone(), tid.clone());
        async move {
            let found: Option<i64> = sqlx::query_scalar(
                "SELECT e.seq FROM execution_events e JOIN attempts a ON a.id = e.attempt_id
                 WHERE a.task_id = $1::uuid AND e.kind = 'output' AND e.payload->>'text' = 'ready'",
            )
            .bind(tid)
            .fetch_optional(&pg)
            .await
            .ok()?;
            found
        }
    })
    .await
    .unwrap();
    let (last, newest, count) = seqs(&stack, &task_id).await;
    assert_eq!((Some(last), count), (newest, last), "while running");
    std::fs::write(&gate, "go").unwrap();
    stack
        .wait_task(&task_id, "succeeded", Duration::from_secs(60))
        .await
        .unwrap();
    let (last, newest, count) = seqs(&stack, &task_id).await;
    assert_eq!((Some(last), count), (newest, last), "after the end");
    let end: String = sqlx::query_scalar(
        "SELECT e.kind FROM execution_events e JOIN attempts a ON a.id = e.attempt_id
         WHERE a.task_id = $1::uuid AND e.seq = a.last_seq",
    )
    .bind(&task_id)
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert_eq!(end, "lifecycle");
    assert!(last > 50, "{last} events for 50 lines");
}

/// Events that come one message at a time, each recorded alone, meet the checks a batch's
/// meet: the next one is stored; a repeat changes nothing; a stale holder's is refused; one
/// ahead of its time waits for the one before it; and once the attempt has ended, nothing more
/// of it is stored, even under its own token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_one_at_a_time_meet_the_checks_of_a_batch() {
    let stack = Stack::start("one-by-one", StackOptions::default())
        .await
        .unwrap();
    let q = Quiet::start(&stack).await;
    let (token, last) = (q.token, q.last);
    let js = async_nats::jetstream::new(stack.nats.service_client("scheduler").await.unwrap());
    let events = js.get_stream(agentscope_bus::STREAM_EVENTS).await.unwrap();
    // Publishes one message and waits until the recorder has settled it (acknowledged it, or,
    // for one that waits for an earlier event, been handed it and not acknowledged it).
    let publish = |payload: Vec<u8>, settled: bool| {
        let (js, events, subject) = (js.clone(), events.clone(), q.subject.clone());
        async move {
            let seq = js
                .publish(subject, payload.into())
                .await
                .unwrap()
                .await
                .unwrap()
                .sequence;
            kit::wait_for(
                "the recorder to take the message",
                Duration::from_secs(30),
                || {
                    let events = events.clone();
                    async move {
                        let c = events
                            .consumer_info(agentscope_bus::CONSUMER_RECORDER)
                            .await
                            .ok()?;
                        let done = if settled {
                            c.ack_floor.stream_sequence >= seq
                        } else {
                            c.delivered.stream_sequence >= seq
                        };
                        done.then_some(())
                    }
                },
            )
            .await
            .unwrap();
        }
    };

    publish(q.event(last + 1, token, "one"), true).await;
    assert_eq!(q.texts(&stack).await, vec![(last + 1, "one".to_string())]);
    // A repeat of seq last+1, with other text: a duplicate, dropped.
    publish(q.event(last + 1, token, "again"), true).await;
    // A stale holder's next event: refused.
    publish(q.event(last + 2, token + 1000, "stale"), true).await;
    assert_eq!(q.texts(&stack).await, vec![(last + 1, "one".to_string())]);
    let rejected = q.rejected(&stack).await;
    assert!(
        rejected.len() == 1 && rejected[0].starts_with("fenced"),
        "{rejected:?}"
    );
    // One ahead of its time waits; the one before it comes, and both are stored in order.
    publish(q.event(last + 3, token, "three"), false).await;
    assert_eq!(q.texts(&stack).await.len(), 1);
    publish(q.event(last + 2, token, "two"), true).await;
    let texts = kit::wait_for("the late event stored", Duration::from_secs(30), || async {
        let rows = q.texts(&stack).await;
        (rows.len() == 3).then_some(rows)
    })
    .await
    .unwrap();
    assert_eq!(
        texts,
        vec![
            (last + 1, "one".to_string()),
            (last + 2, "two".to_string()),
            (last + 3, "three".to_string()),
        ]
    );

    // The attempt ends (cancelled); its holder's token no longer stores anything.
    stack
        .api
        .post(
            &format!("/v1/tasks/{}/cancel", q.task_id),
            json!({"reason": "test"}),
        )
        .await
        .unwrap();
    stack
        .wait_task(&q.task_id, "cancelled", Duration::from_secs(60))
        .await
        .unwrap();
    let end: i64 = sqlx::query_scalar("SELECT last_seq FROM attempts WHERE id = $1::uuid")
        .bind(&q.attempt_id)
        .fetch_one(&stack.pg)
        .await
        .unwrap();
    publish(q.event(end + 1, token, "after the end"), true).await;
    let stored: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM execution_events WHERE attempt_id = $1::uuid AND seq > $2",
    )
    .bind(&q.attempt_id)
    .bind(end)
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    assert_eq!(stored, 0);
    let rejected = q.rejected(&stack).await;
    assert!(
        rejected.iter().any(|r| r.contains("already")),
        "{rejected:?}"
    );
}

/// A stopping gateway ends every open live stream with `shutdown` (the client resumes elsewhere
/// with `Last-Event-ID`) and exits cleanly, well within its grace period (10 s) rather than
/// waiting it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_gateway_ends_open_streams_and_exits_within_its_grace_period() {
    let mut stack = Stack::start("sse-shutdown", StackOptions::default())
        .await
        .unwrap();
    // No host serves the pool: the task stays queued and its streams stay open and quiet.
    let (agent, _) = stack
        .command_agent("idle", "nowhere", &["true"], None)
        .await
        .unwrap();
    let mut paths = Vec::new();
    for _ in 0..2 {
        let id = stack.submit(json!({"agent_id": agent})).await.unwrap();
        paths.push(format!("/v1/tasks/{id}/events"));
        let attempt: String = kit::wait_for("the first attempt", Duration::from_secs(30), || {
            let (pg, id) = (stack.pg.clone(), id.clone());
            async move {
                sqlx::query_scalar("SELECT id::text FROM attempts WHERE task_id = $1::uuid")
                    .bind(id)
                    .fetch_optional(&pg)
                    .await
                    .ok()
                    .flatten()
            }
        })
        .await
        .unwrap();
        paths.push(format!("/v1/attempts/{attempt}/events"));
    }
    let before = sse_streams(&stack.api).await.unwrap();
    let readers: Vec<_> = paths
        .iter()
        .map(|p| {
            let (api, p) = (stack.api.clone(), p.clone());
            tokio::spawn(
                async move { sse_collect(&api, &p, None, None, Duration::from_secs(60)).await },
            )
        })
        .collect();
    let api = stack.api.clone();
    let want = before + readers.len() as u64;
    kit::wait_for("every stream open", Duration::from_secs(30), || {
        let api = api.clone();
        async move { (sse_streams(&api).await? >= want).then_some(()) }
    })
    .await
    .unwrap();

    let started = std::time::Instant::now();
    let status = tokio::task::block_in_place(|| stack.gateway.terminate(Duration::from_secs(30)));
    let took = started.elapsed();
    assert!(
        status.is_some_and(|s| s.success()),
        "graceful exit: {status:?}"
    );
    assert!(took < Duration::from_secs(10), "stopped in {took:?}");
    for (reader, path) in readers.into_iter().zip(&paths) {
        let events = reader.await.unwrap().unwrap();
        let kinds: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
        assert_eq!(kinds, ["shutdown"], "{path}");
        assert_eq!(events[0].data, r#"{"resume":true}"#, "{path}");
    }
}

/// The first message of an attempt's events in the stream: its `Nats-Msg-Id`, and the kinds of
/// the events stored for the attempt in seq order.
async fn first_message(stack: &Stack, task_id: &str) -> (String, Vec<String>) {
    let (attempt_id, host_id): (String, String) = sqlx::query_as(
        "SELECT id::text, host_id::text FROM attempts WHERE task_id = $1::uuid AND number = 1",
    )
    .bind(task_id)
    .fetch_one(&stack.pg)
    .await
    .unwrap();
    let js = async_nats::jetstream::new(stack.nats.service_client("scheduler").await.unwrap());
    let first = js
        .get_stream(agentscope_bus::STREAM_EVENTS)
        .await
        .unwrap()
        .direct_get_first_for_subject(agentscope_bus::subjects::events(&host_id, &attempt_id))
        .await
        .unwrap();
    let id = first
        .headers
        .get("Nats-Msg-Id")
        .map(|v| v.as_str().to_string())
        .unwrap_or_default();
    let kinds: Vec<String> = sqlx::query_scalar(
        "SELECT CASE WHEN kind = 'diagnostic' THEN 'diagnostic ' || (payload->>'code')
                     WHEN kind = 'lifecycle' THEN 'lifecycle ' || (payload->>'state')
                     ELSE kind END
         FROM execution_events WHERE attempt_id = $1::uuid ORDER BY seq",
    )
    .bind(&attempt_id)
    .fetch_all(&stack.pg)
    .await
    .unwrap();
    (
        id.strip_prefix(&format!("{attempt_id}:"))
            .unwrap()
            .to_string(),
        kinds,
    )
}

/// An attempt's informational diagnostics wait (`event_linger_ms`) for its next event and go out
/// with it: `preparing` travels with `running` in the attempt's first message, one transaction
/// of the recorder instead of two. With the wait set to 0 the attempt's events are all recorded
/// as well; where its first message ends then depends on how soon the host's publisher runs
/// (events handed over before it does go together), so that is not asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempts_preparing_diagnostic_goes_out_with_its_running_event() {
    let stack = Stack::start("linger", StackOptions::default())
        .await
        .unwrap();
    for (pool, linger, lingers) in [("long", "60000", true), ("none", "0", false)] {
        // The agent first: it makes the pool the host joins.
        let (agent, _) = stack
            .command_agent(pool, pool, &["echo", "hi"], None)
            .await
            .unwrap();
        let state = stack.dir.path.join(format!("host-{pool}-state"));
        let _host = stack
            .spawn_host(
                pool,
                pool,
                1,
                &state,
                &[("AGENTSCOPE_EVENT_LINGER_MS", linger)],
            )
            .unwrap();
        stack.wait_host_ready(pool).await.unwrap();
        let task_id = stack.submit(json!({"agent_id": agent})).await.unwrap();
        stack
            .wait_task(&task_id, "succeeded", Duration::from_secs(60))
            .await
            .unwrap();
        let (id, kinds) = first_message(&stack, &task_id).await;
        assert_eq!(kinds[0], "diagnostic preparing", "{kinds:?}");
        let running = kinds.iter().position(|k| k == "lifecycle running").unwrap();
        let first = id.split_once('-').map_or(id.as_str(), |(first, _)| first);
        assert_eq!(first, "1", "{id}");
        if lingers {
            // Events 1..=n in one batch, `running` among them (a linger of a minute: nothing
            // but the next event can have sent it).
            let (_, last) = id.split_once('-').expect("a batch");
            assert!(last.parse::<usize>().unwrap() > running, "{id} {kinds:?}");
        }
        assert_eq!(kinds.last().unwrap(), "lifecycle succeeded", "{kinds:?}");
    }
}
