//! A mocked apiserver for the watch and status tests (no cluster in CI): a
//! `tower_test` service behind a real `kube::Client`, serving a [`Scenario`] and
//! recording every request it receives.
//!
//! - LIST (`GET` without `watch=true`) answers the scenario's objects of that
//!   resource, all namespaces.
//! - The first WATCH of a resource answers the scenario's events for it once the
//!   test calls [`ApiServer::release`]; every other WATCH is held open.
//! - PATCH `…/status` answers the object named, `POST` creates; the CacheIndex
//!   singleton answers 404 until created when the scenario says it is missing.
//! - A resource in [`Scenario::missing`] (its CRD not installed) answers the
//!   apiserver's plain-text 404.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use kube::Client;
use kube::client::Body;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::Notify;

/// What the apiserver holds and will send.
#[derive(Default)]
pub struct Scenario {
    /// Resource plural (`cachepolicies`, `pods`, …) → objects listed.
    pub lists: HashMap<&'static str, Vec<Value>>,
    /// Resource plural → watch events (`{"type": …, "object": …}`) sent on release.
    pub events: HashMap<&'static str, Vec<Value>>,
    /// Whether the CacheIndex singleton exists already.
    pub cache_index_exists: bool,
    /// Resource plurals whose CRD is not installed: every request gets 404.
    pub missing: Vec<&'static str>,
}

/// One request as received: method, path with query, JSON body if any.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: Method,
    pub uri: String,
    pub body: Option<Value>,
}

/// The running mock.
pub struct ApiServer {
    pub seen: Arc<Mutex<Vec<Seen>>>,
    release: Arc<Notify>,
}

impl ApiServer {
    /// Starts the mock; returns a client talking to it.
    pub fn start(scenario: Scenario) -> (Client, ApiServer) {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let release = Arc::new(Notify::new());
        let server = ApiServer {
            seen: seen.clone(),
            release: release.clone(),
        };
        tokio::spawn(async move {
            let mut scenario = scenario;
            let mut released = false;
            let mut watched: Vec<String> = Vec::new();
            let mut pending = Vec::new();
            let mut held = Vec::new();
            loop {
                tokio::select! {
                    next = handle.next_request() => {
                        let Some((request, send)) = next else { return };
                        let (parts, body) = request.into_parts();
                        let bytes = body.collect_bytes().await.unwrap_or_default();
                        let body: Option<Value> = serde_json::from_slice(&bytes).ok();
                        let uri = parts.uri.to_string();
                        seen.lock().push(Seen { method: parts.method.clone(), uri: uri.clone(), body: body.clone() });
                        let path = parts.uri.path().to_string();
                        let query = parts.uri.query().unwrap_or("");
                        let resource = resource_of(&path);
                        if scenario.missing.contains(&resource.as_str()) {
                            send.send_response(no_such_resource());
                        } else if parts.method == Method::GET && query.contains("watch=true") {
                            let first = !watched.contains(&resource);
                            watched.push(resource.clone());
                            match scenario.events.get(resource.as_str()) {
                                Some(_) if first && released => {
                                    send.send_response(watch_body(scenario.events.remove(resource.as_str()).unwrap_or_default()));
                                }
                                Some(_) if first => pending.push((resource, send)),
                                _ => held.push(send),
                            }
                        } else if parts.method == Method::GET {
                            let items = scenario.lists.get(resource.as_str()).cloned().unwrap_or_default();
                            send.send_response(ok(json!({
                                "apiVersion": "v1", "kind": "List",
                                "metadata": {"resourceVersion": "1"}, "items": items,
                            })));
                        } else {
                            send.send_response(write(&mut scenario, &parts.method, &path, body));
                        }
                    }
                    () = release.notified(), if !released => {
                        released = true;
                        for (resource, send) in pending.drain(..) {
                            let events = scenario.events.remove(resource.as_str()).unwrap_or_default();
                            send.send_response(watch_body(events));
                        }
                    }
                }
            }
        });
        (client, server)
    }

    /// Sends the scenario's watch events.
    pub fn release(&self) {
        self.release.notify_one();
    }

    pub fn requests(&self) -> Vec<Seen> {
        self.seen.lock().clone()
    }
}

/// `/api/v1/pods` → `pods`; `/apis/g/v/namespaces/ns/kinds/name/status` → `kinds`.
fn resource_of(path: &str) -> String {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let rest = if parts.first() == Some(&"api") {
        &parts[2..]
    } else {
        &parts[3.min(parts.len())..]
    };
    let rest = if rest.first() == Some(&"namespaces") && rest.len() > 2 {
        &rest[2..]
    } else {
        rest
    };
    rest.first().map(|s| s.to_string()).unwrap_or_default()
}

fn ok(v: Value) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .body(Body::from(serde_json::to_vec(&v).unwrap_or_default()))
        .unwrap()
}

fn watch_body(events: Vec<Value>) -> Response<Body> {
    let mut text = Vec::new();
    for e in events {
        text.extend(serde_json::to_vec(&e).unwrap_or_default());
        text.push(b'\n');
    }
    Response::builder()
        .status(StatusCode::OK)
        .body(Body::from(text))
        .unwrap()
}

/// What a real apiserver answers for a resource whose CRD is not installed: a
/// plain-text 404, no `Status` body.
fn no_such_resource() -> Response<Body> {
    Response::builder()
        .status(StatusCode::NOT_FOUND)
        .header("content-type", "text/plain; charset=utf-8")
        .body(Body::from(b"404 page not found\n".to_vec()))
        .unwrap()
}

fn not_found(name: &str) -> Response<Body> {
    let status = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "message": format!("{name} not found"), "reason": "NotFound", "code": 404});
    Response::builder()
        .status(StatusCode::NOT_FOUND)
        .body(Body::from(serde_json::to_vec(&status).unwrap_or_default()))
        .unwrap()
}

/// PATCH (status) and POST (create): answer the object with the body applied.
fn write(
    scenario: &mut Scenario,
    method: &Method,
    path: &str,
    body: Option<Value>,
) -> Response<Body> {
    let resource = resource_of(path);
    let segments: Vec<&str> = path.split('/').collect();
    let body = body.unwrap_or(Value::Null);
    if resource == "cacheindexes" {
        if *method == Method::POST {
            scenario.cache_index_exists = true;
            return ok(body);
        }
        if !scenario.cache_index_exists {
            return not_found("cacheindexes/cluster");
        }
        let mut obj = json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheIndex",
            "metadata": {"name": "cluster"}, "status": {}});
        merge(&mut obj, &body);
        return ok(obj);
    }
    // …/<resource>/<name>/status
    let name = segments
        .iter()
        .position(|s| *s == resource)
        .and_then(|i| segments.get(i + 1))
        .copied()
        .unwrap_or("");
    let found = scenario
        .lists
        .get(resource.as_str())
        .and_then(|items| items.iter().find(|o| o["metadata"]["name"] == name))
        .cloned();
    match found {
        Some(mut obj) => {
            merge(&mut obj, &body);
            ok(obj)
        }
        None => not_found(name),
    }
}

/// RFC 7386 JSON merge patch, as the apiserver applies it.
fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    if let Value::Object(t) = target {
        for (k, v) in patch {
            if v.is_null() {
                t.remove(k);
            } else {
                merge(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

/// Awaits `f` for at most a second (a hung mock fails the test, not the run).
pub async fn timeout_after_1s<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(1), f)
        .await
        .expect("timed out after 1s")
}
