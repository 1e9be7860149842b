use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

use super::*;

/// The peer side, written byte by byte from RFC 23 (not with our own code).
async fn peer_greets(peer: &mut DuplexStream, socket_type: &[u8]) {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    peer.write_all(&g).await.unwrap();
    let mut theirs = [0u8; 64];
    peer.read_exact(&mut theirs).await.unwrap();
    assert_eq!((theirs[0], theirs[9], theirs[10]), (0xff, 0x7f, 3));
    assert_eq!(&theirs[12..17], b"NULL\0");
    let mut ready = vec![5];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    ready.extend_from_slice(socket_type);
    peer.write_all(&[0x04, ready.len() as u8]).await.unwrap();
    peer.write_all(&ready).await.unwrap();
    // Their READY: a short command frame naming SUB.
    let mut head = [0u8; 2];
    peer.read_exact(&mut head).await.unwrap();
    assert_eq!(head[0], 0x04);
    let mut body = vec![0u8; usize::from(head[1])];
    peer.read_exact(&mut body).await.unwrap();
    assert!(body.starts_with(b"\x05READY\x0bSocket-Type"));
}

async fn connect(
    socket_type: &'static [u8],
    limits: Limits,
) -> (
    Connection<tokio::io::ReadHalf<DuplexStream>, tokio::io::WriteHalf<DuplexStream>>,
    DuplexStream,
) {
    let (ours, mut peer) = tokio::io::duplex(1 << 16);
    let (rd, wr) = tokio::io::split(ours);
    let (conn, ()) = tokio::join!(
        Connection::handshake_over(rd, wr, SocketType::Sub, limits, Duration::from_secs(2)),
        peer_greets(&mut peer, socket_type)
    );
    (conn.unwrap(), peer)
}

#[tokio::test]
async fn receives_multipart_messages_short_and_long_frames() {
    let (mut conn, mut peer) = connect(b"PUB", Limits::default()).await;
    let long = vec![7u8; 300];
    let mut wire = vec![0x01, 2, b'k', b'v', 0x01, 8];
    wire.extend_from_slice(&5u64.to_be_bytes());
    wire.push(0x02);
    wire.extend_from_slice(&300u64.to_be_bytes());
    wire.extend_from_slice(&long);
    peer.write_all(&wire).await.unwrap();
    let msg = conn.recv().await.unwrap();
    assert_eq!(msg.len(), 3);
    assert_eq!(&msg[0][..], b"kv");
    assert_eq!(&msg[1][..], &5u64.to_be_bytes());
    assert_eq!(&msg[2][..], &long[..]);
}

#[tokio::test]
async fn a_one_tib_frame_header_is_refused_before_anything_is_allocated() {
    let (mut conn, mut peer) = connect(b"PUB", Limits::default()).await;
    let mut wire = vec![0x02];
    wire.extend_from_slice(&(1u64 << 40).to_be_bytes());
    peer.write_all(&wire).await.unwrap();
    match conn.recv().await {
        Err(ZmtpError::Oversized { announced, limit }) => {
            assert_eq!(announced, 1 << 40);
            assert_eq!(limit, DEFAULT_MAX_MESSAGE_BYTES);
        }
        other => panic!("expected Oversized, got {:?}", other.map(|m| m.len())),
    }
}

#[tokio::test]
async fn the_limit_is_on_the_whole_message() {
    let limits = Limits {
        max_message_bytes: 100,
        max_frames: 4,
    };
    let (mut conn, mut peer) = connect(b"XPUB", limits).await;
    // 60 + 60 bytes: each frame fits, the message does not.
    let mut wire = vec![0x01, 60];
    wire.extend_from_slice(&[0; 60]);
    wire.extend_from_slice(&[0x00, 60]);
    wire.extend_from_slice(&[0; 60]);
    peer.write_all(&wire).await.unwrap();
    assert!(matches!(
        conn.recv().await,
        Err(ZmtpError::Oversized {
            announced: 120,
            limit: 100
        })
    ));
}

#[tokio::test]
async fn too_many_frames_and_bad_flags_are_errors() {
    let limits = Limits {
        max_message_bytes: 1000,
        max_frames: 2,
    };
    let (mut conn, mut peer) = connect(b"PUB", limits).await;
    peer.write_all(&[0x01, 0, 0x01, 0, 0x00, 0]).await.unwrap();
    assert!(matches!(
        conn.recv().await,
        Err(ZmtpError::TooManyFrames(2))
    ));
    let (mut conn, mut peer) = connect(b"PUB", limits).await;
    peer.write_all(&[0x40, 0]).await.unwrap();
    assert!(matches!(conn.recv().await, Err(ZmtpError::Protocol(_))));
}

#[tokio::test]
async fn ping_is_answered_and_a_wrong_peer_type_refused() {
    let (mut conn, mut peer) = connect(b"PUB", Limits::default()).await;
    let mut ping = vec![0x04, 9, 4];
    ping.extend_from_slice(b"PING");
    ping.extend_from_slice(&[0, 10, b'c', b'x']);
    ping.extend_from_slice(&[0x00, 1, b'm']);
    peer.write_all(&ping).await.unwrap();
    let msg = conn.recv().await.unwrap();
    assert_eq!(msg, vec![Bytes::from_static(b"m")]);
    let mut pong = [0u8; 9];
    peer.read_exact(&mut pong).await.unwrap();
    assert_eq!(&pong, b"\x04\x07\x04PONGcx");

    let (ours, mut peer) = tokio::io::duplex(1 << 16);
    let (rd, wr) = tokio::io::split(ours);
    let (conn, ()) = tokio::join!(
        Connection::handshake_over(
            rd,
            wr,
            SocketType::Sub,
            Limits::default(),
            Duration::from_secs(2)
        ),
        peer_greets(&mut peer, b"ROUTER")
    );
    assert!(matches!(conn, Err(ZmtpError::Protocol(_))));
}

#[tokio::test]
async fn a_silent_peer_times_the_handshake_out() {
    let (ours, _peer) = tokio::io::duplex(1 << 16);
    let (rd, wr) = tokio::io::split(ours);
    let r = Connection::handshake_over(
        rd,
        wr,
        SocketType::Dealer,
        Limits::default(),
        Duration::from_millis(50),
    )
    .await;
    assert!(matches!(r, Err(ZmtpError::HandshakeTimeout)));
}
