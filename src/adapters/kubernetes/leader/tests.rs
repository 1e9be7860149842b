//! The election against an in-memory Lease endpoint with optimistic concurrency,
//! on tokio's paused clock: each replica's connection can be cut (its requests
//! are then never answered, as behind a dead network path).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use parking_lot::Mutex;
use serde_json::{Value, json};

use super::*;

const NS: &str = "inferencecache-system";
const NAME: &str = "inferencecache-status";

/// The Lease as the apiserver stores it, and every successful write.
#[derive(Default)]
struct Store {
    lease: Option<Value>,
    version: u64,
    /// (when, holderIdentity) of each accepted write.
    writes: Vec<(Instant, Option<String>)>,
}

#[derive(Clone, Default)]
struct LeaseServer {
    store: Arc<Mutex<Store>>,
}

impl LeaseServer {
    /// A client of this server whose path the test can cut.
    fn client(&self) -> (Client, Arc<AtomicBool>) {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let cut = Arc::new(AtomicBool::new(false));
        let (store, is_cut) = (self.store.clone(), cut.clone());
        tokio::spawn(async move {
            let mut unanswered = Vec::new();
            while let Some((request, send)) = handle.next_request().await {
                if is_cut.load(Ordering::SeqCst) {
                    unanswered.push(send);
                    continue;
                }
                let (parts, body) = request.into_parts();
                let bytes = body.collect_bytes().await.unwrap_or_default();
                let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                send.send_response(answer(&store, &parts.method, parts.uri.path(), body));
            }
        });
        (Client::new(service, "default"), cut)
    }

    fn holder(&self) -> Option<String> {
        self.store
            .lock()
            .lease
            .as_ref()
            .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string))
    }

    fn last_write_by(&self, who: &str) -> Option<Instant> {
        let store = self.store.lock();
        store
            .writes
            .iter()
            .rev()
            .find(|(_, h)| h.as_deref() == Some(who))
            .map(|(at, _)| *at)
    }
}

fn answer(store: &Mutex<Store>, method: &Method, path: &str, body: Value) -> Response<Body> {
    let collection = format!("/apis/coordination.k8s.io/v1/namespaces/{NS}/leases");
    let item = format!("{collection}/{NAME}");
    let mut s = store.lock();
    let (code, out) = match (method.clone(), path) {
        (Method::GET, p) if p == item => match &s.lease {
            Some(l) => (StatusCode::OK, l.clone()),
            None => status(404, "NotFound"),
        },
        (Method::POST, p) if p == collection => {
            if s.lease.is_some() {
                status(409, "AlreadyExists")
            } else {
                (StatusCode::CREATED, store_write(&mut s, body))
            }
        }
        (Method::PUT, p) if p == item => {
            let current = s
                .lease
                .as_ref()
                .map(|l| l["metadata"]["resourceVersion"].clone());
            if current != Some(body["metadata"]["resourceVersion"].clone()) {
                status(409, "Conflict")
            } else {
                (StatusCode::OK, store_write(&mut s, body))
            }
        }
        _ => status(404, "NotFound"),
    };
    Response::builder()
        .status(code)
        .body(Body::from(serde_json::to_vec(&out).unwrap_or_default()))
        .expect("a response")
}

fn store_write(s: &mut Store, mut body: Value) -> Value {
    s.version += 1;
    body["metadata"]["resourceVersion"] = json!(s.version.to_string());
    let holder = body["spec"]["holderIdentity"].as_str().map(str::to_string);
    s.writes.push((Instant::now(), holder));
    s.lease = Some(body.clone());
    body
}

fn status(code: u16, reason: &str) -> (StatusCode, Value) {
    (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
               "message": reason, "reason": reason, "code": code}),
    )
}

fn config(identity: &str) -> LeaseConfig {
    LeaseConfig {
        namespace: NS.into(),
        name: NAME.into(),
        identity: identity.into(),
        duration: Duration::from_secs(15),
    }
}

/// Waits (on the paused clock) until `leads` says `want`; the instant it did.
async fn until_leads(l: &Leadership, want: bool, within: Duration) -> Instant {
    let end = Instant::now() + within;
    while l.leads() != want {
        assert!(Instant::now() < end, "leads() never became {want}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Instant::now()
}

#[tokio::test(start_paused = true)]
async fn leadership_ends_locally_at_the_last_renewal_plus_duration_minus_margin() {
    let server = LeaseServer::default();
    let (client, cut) = server.client();
    let (leadership, _resign) = elect(client, config("a"));
    until_leads(&leadership, true, Duration::from_secs(2)).await;
    assert_eq!(server.holder().as_deref(), Some("a"));
    // Renewals keep it leading well past one duration.
    tokio::time::sleep(Duration::from_secs(40)).await;
    assert!(leadership.leads());
    assert!(server.store.lock().writes.len() >= 10);

    cut.store(true, Ordering::SeqCst);
    let last = server.last_write_by("a").expect("a renewed");
    let ended = until_leads(&leadership, false, Duration::from_secs(30)).await;
    // The apiserver never said anything: the Lease still names "a", and the
    // replica stopped on its own clock, 15 s − 3 s after its last renewal began.
    assert_eq!(server.holder().as_deref(), Some("a"));
    let deadline = last + Duration::from_secs(12);
    assert!(
        ended >= deadline && ended <= deadline + Duration::from_millis(20),
        "ended {:?} after the last renewal",
        ended - last
    );
}

#[tokio::test(start_paused = true)]
async fn a_cut_off_leader_stops_before_another_replica_takes_over() {
    let server = LeaseServer::default();
    let (client_a, cut_a) = server.client();
    let (a, _resign_a) = elect(client_a, config("a"));
    until_leads(&a, true, Duration::from_secs(2)).await;
    let (client_b, _) = server.client();
    let (b, _resign_b) = elect(client_b, config("b"));
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert!(
        a.leads() && !b.leads(),
        "a live holder's Lease is not taken"
    );

    let cut_at = Instant::now();
    cut_a.store(true, Ordering::SeqCst);
    let a_stopped = until_leads(&a, false, Duration::from_secs(30)).await;
    let b_started = until_leads(&b, true, Duration::from_secs(30)).await;
    let margin = config("a").margin();
    assert!(
        b_started >= a_stopped + margin,
        "a stopped {:?} after the cut, b started {:?} after it",
        a_stopped - cut_at,
        b_started - cut_at
    );
    // b waited out one whole duration from its last sight of a's renewal.
    assert!(
        b_started - cut_at <= Duration::from_secs(15) + Duration::from_secs(2),
        "{:?}",
        b_started - cut_at
    );
    assert_eq!(server.holder().as_deref(), Some("b"));
}

#[tokio::test(start_paused = true)]
async fn resigning_stops_at_once_and_hands_the_lease_over_within_a_poll() {
    let server = LeaseServer::default();
    let (client_a, _) = server.client();
    let (a, resign_a) = elect(client_a, config("a"));
    until_leads(&a, true, Duration::from_secs(2)).await;
    let (client_b, _) = server.client();
    let (b, _resign_b) = elect(client_b, config("b"));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!b.leads());

    let resigned_at = Instant::now();
    resign_a.resign(Duration::from_secs(2)).await;
    assert!(!a.leads(), "a resigned replica does not lead");
    assert_ne!(
        server.holder().as_deref(),
        Some("a"),
        "the Lease is released"
    );
    let b_started = until_leads(&b, true, Duration::from_secs(5)).await;
    assert!(
        b_started - resigned_at <= config("b").poll_every() + Duration::from_millis(50),
        "{:?}",
        b_started - resigned_at
    );
    assert_eq!(server.holder().as_deref(), Some("b"));
}

#[tokio::test(start_paused = true)]
async fn two_replicas_starting_together_elect_one() {
    let server = LeaseServer::default();
    let (ca, _) = server.client();
    let (cb, _) = server.client();
    let (a, _ra) = elect(ca, config("a"));
    let (b, _rb) = elect(cb, config("b"));
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(a.leads() != b.leads(), "a {} b {}", a.leads(), b.leads());
}
