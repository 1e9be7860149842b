use super::*;

#[tokio::test]
async fn start_wakes_waiters_and_guards_count_streams() {
    let drain = Drain::new();
    assert!(!drain.is_draining());
    let waiter = tokio::spawn({
        let d = drain.clone();
        async move { d.started().await }
    });
    let a = drain.stream();
    let b = drain.stream();
    assert_eq!(drain.in_flight(), 2);
    drop(a);
    assert_eq!(drain.in_flight(), 1);
    drain.start();
    tokio::time::timeout(std::time::Duration::from_secs(1), waiter)
        .await
        .expect("the waiter wakes on start")
        .unwrap();
    assert!(drain.is_draining());
    // Already started: resolves at once.
    drain.started().await;
    drop(b);
    assert_eq!(drain.in_flight(), 0);
}
