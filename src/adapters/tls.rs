//! TLS for the gRPC listeners: PEM files named by flags, or (ext_proc listener
//! only) a self-signed certificate generated at start, as GIE's endpoint picker
//! does by default — gateways call it over TLS without verifying the certificate.
//! Plaintext stays the default.

use std::path::Path;

use anyhow::{Context, bail};
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

/// Where a listener's TLS identity comes from.
#[derive(Clone, Copy, Debug)]
pub struct TlsFiles<'a> {
    /// The flag names, for error messages (`--grpc-tls-cert`, ...).
    pub cert_flag: &'static str,
    pub key_flag: &'static str,
    pub cert: Option<&'a Path>,
    pub key: Option<&'a Path>,
    /// A CA bundle: require client certificates signed by it (mTLS).
    pub client_ca: Option<(&'static str, &'a Path)>,
    /// Generate a self-signed certificate instead of reading files.
    pub self_signed: bool,
}

/// The server TLS config, or `None` for plaintext. Every file is read now, so a
/// bad path fails the start, not the first handshake.
pub fn server_tls(files: TlsFiles<'_>) -> anyhow::Result<Option<ServerTlsConfig>> {
    let read = |flag: &str, path: &Path| {
        std::fs::read(path).with_context(|| format!("reading {flag} {}", path.display()))
    };
    let identity = match (files.cert, files.key, files.self_signed) {
        (Some(_), _, true) | (_, Some(_), true) => bail!(
            "{} / {} and a self-signed certificate are exclusive",
            files.cert_flag,
            files.key_flag
        ),
        (Some(cert), Some(key), false) => {
            Identity::from_pem(read(files.cert_flag, cert)?, read(files.key_flag, key)?)
        }
        (None, None, true) => self_signed()?,
        (None, None, false) => {
            if let Some((flag, _)) = files.client_ca {
                bail!("{flag} needs {} and {}", files.cert_flag, files.key_flag);
            }
            return Ok(None);
        }
        _ => bail!("{} and {} go together", files.cert_flag, files.key_flag),
    };
    let mut tls = ServerTlsConfig::new().identity(identity);
    if let Some((flag, ca)) = files.client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read(flag, ca)?));
    }
    Ok(Some(tls))
}

/// A fresh key pair and certificate for `localhost` and the pod's hostname; it
/// lives as long as the process (clients that verify need real files instead).
fn self_signed() -> anyhow::Result<Identity> {
    let (cert, key) = self_signed_pem()?;
    Ok(Identity::from_pem(cert, key))
}

fn self_signed_pem() -> anyhow::Result<(String, String)> {
    let mut names = vec!["localhost".to_string()];
    if let Ok(host) = std::env::var("HOSTNAME")
        && !host.is_empty()
        && host != "localhost"
    {
        names.push(host);
    }
    let generated = rcgen::generate_simple_self_signed(names)
        .context("generating a self-signed certificate")?;
    Ok((generated.cert.pem(), generated.signing_key.serialize_pem()))
}

#[cfg(test)]
mod tests;
