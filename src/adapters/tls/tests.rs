use super::*;

fn files<'a>(cert: Option<&'a Path>, key: Option<&'a Path>, self_signed: bool) -> TlsFiles<'a> {
    TlsFiles {
        cert_flag: "--grpc-tls-cert",
        key_flag: "--grpc-tls-key",
        cert,
        key,
        client_ca: None,
        self_signed,
    }
}

#[test]
fn plaintext_by_default() {
    assert!(server_tls(files(None, None, false)).unwrap().is_none());
}

#[test]
fn self_signed_is_a_pem_pair() {
    let (cert, key) = self_signed_pem().unwrap();
    assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"));
    assert!(key.contains("PRIVATE KEY-----"));
    assert!(server_tls(files(None, None, true)).unwrap().is_some());
}

#[test]
fn flags_that_do_not_fit_are_refused_with_their_names() {
    let p = Path::new("/nonexistent.pem");
    let e = server_tls(files(Some(p), Some(p), true))
        .unwrap_err()
        .to_string();
    assert!(e.contains("exclusive"), "{e}");
    let e = server_tls(files(Some(p), None, false))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--grpc-tls-key"), "{e}");
    let e = server_tls(files(Some(p), Some(p), false))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("reading --grpc-tls-cert /nonexistent.pem"),
        "{e}"
    );
}
