//! Mutual TLS for the transfer transports: a development CA, component certificates signed by it, PEM files,
//! and quinn configurations that accept only peers whose certificate chains to the cluster CA (TLS 1.3 only).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// ALPN of Tandem's KV transfer protocol.
pub const ALPN: &[u8] = b"tandem-kv/1";
const CA_NAME: &str = "Tandem development CA";

/// Why certificates or TLS settings could not be made or read.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {what}")]
    Pem { path: PathBuf, what: String },
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// A development certificate authority: signs component certificates for a local or test cluster.
#[derive(Debug)]
pub struct DevCa {
    key: KeyPair,
    cert_pem: String,
    cert: CertificateDer<'static>,
}

fn ca_params() -> Result<CertificateParams, rcgen::Error> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.distinguished_name.push(DnType::CommonName, CA_NAME);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    Ok(p)
}

impl DevCa {
    /// A new CA with a fresh key.
    pub fn generate() -> Result<DevCa, TlsError> {
        let key = KeyPair::generate()?;
        let cert = ca_params()?.self_signed(&key)?;
        Ok(DevCa { cert_pem: cert.pem(), cert: cert.der().clone(), key })
    }

    /// The CA's certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate for component `name`, valid for TLS server and client use, for `name`, `localhost` and the
    /// loopback addresses plus `extra_names` (DNS names or IP addresses).
    pub fn issue(&self, name: &str, extra_names: &[String]) -> Result<Identity, TlsError> {
        let mut names = vec![name.to_string(), "localhost".into(), "127.0.0.1".into(), "::1".into()];
        names.extend(extra_names.iter().cloned());
        names.dedup();
        let mut p = CertificateParams::new(names)?;
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate()?;
        let issuer = Issuer::new(ca_params()?, &self.key);
        let cert = p.signed_by(&key, &issuer)?;
        Ok(Identity {
            ca: self.cert.clone(),
            chain: vec![cert.der().clone()],
            key: PrivateKeyDer::try_from(key.serialize_der()).map_err(|e| TlsError::Config(e.to_string()))?,
            pem: Pem { ca: self.cert_pem.clone(), cert: cert.pem(), key: key.serialize_pem() },
        })
    }

    /// Writes `ca.pem` and `ca.key` (owner-only) into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), TlsError> {
        write_file(&dir.join("ca.pem"), self.cert_pem.as_bytes(), false)?;
        write_file(&dir.join("ca.key"), self.key.serialize_pem().as_bytes(), true)
    }
}

#[derive(Clone, Debug)]
struct Pem {
    ca: String,
    cert: String,
    key: String,
}

/// What a component presents and trusts: its certificate chain and key, and the cluster CA.
#[derive(Debug)]
pub struct Identity {
    pub ca: CertificateDer<'static>,
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    pem: Pem,
}

fn write_file(path: &Path, bytes: &[u8], secret: bool) -> Result<(), TlsError> {
    let io = |source| TlsError::Io { path: path.to_path_buf(), source };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    std::fs::write(path, bytes).map_err(io)?;
    if secret {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    }
    Ok(())
}

impl Identity {
    /// Writes `<name>.pem` and `<name>.key` (owner-only) into `dir`, next to the CA's `ca.pem`.
    pub fn write(&self, dir: &Path, name: &str) -> Result<(), TlsError> {
        let pem = &self.pem;
        write_file(&dir.join("ca.pem"), pem.ca.as_bytes(), false)?;
        write_file(&dir.join(format!("{name}.pem")), pem.cert.as_bytes(), false)?;
        write_file(&dir.join(format!("{name}.key")), pem.key.as_bytes(), true)
    }

    /// Reads what [`Identity::write`] wrote: `ca.pem`, `<name>.pem` and `<name>.key` in `dir`.
    pub fn load(dir: &Path, name: &str) -> Result<Identity, TlsError> {
        Identity::from_pem_files(
            &dir.join("ca.pem"),
            &dir.join(format!("{name}.pem")),
            &dir.join(format!("{name}.key")),
        )
    }

    /// Reads a CA certificate, a certificate chain and a private key from PEM files.
    pub fn from_pem_files(ca: &Path, cert: &Path, key: &Path) -> Result<Identity, TlsError> {
        let read =
            |p: &Path| std::fs::read_to_string(p).map_err(|source| TlsError::Io { path: p.to_path_buf(), source });
        let pem_err = |p: &Path, what: String| TlsError::Pem { path: p.to_path_buf(), what };
        let pem = Pem { ca: read(ca)?, cert: read(cert)?, key: read(key)? };
        let ca_der = CertificateDer::from_pem_slice(pem.ca.as_bytes()).map_err(|e| pem_err(ca, e.to_string()))?;
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem.cert.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|e| pem_err(cert, e.to_string()))?;
        if chain.is_empty() {
            return Err(pem_err(cert, "no certificate in the file".into()));
        }
        let key_der = PrivateKeyDer::from_pem_slice(pem.key.as_bytes()).map_err(|e| pem_err(key, e.to_string()))?;
        Ok(Identity { ca: ca_der, chain, key: key_der, pem })
    }

    /// The cluster CA's certificate, PEM.
    pub fn ca_pem(&self) -> &str {
        &self.pem.ca
    }

    /// This component's certificate chain, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.pem.cert
    }

    /// This component's private key, PEM.
    pub fn key_pem(&self) -> &str {
        &self.pem.key
    }

    fn roots(&self) -> Result<RootCertStore, TlsError> {
        let mut roots = RootCertStore::empty();
        roots.add(self.ca.clone()).map_err(|e| TlsError::Config(format!("cluster CA: {e}")))?;
        Ok(roots)
    }

    /// A TLS 1.3 server configuration speaking `alpn` that requires a client certificate from the cluster CA.
    pub fn tls_server(&self, alpn: &[u8]) -> Result<rustls::ServerConfig, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(self.roots()?), Arc::clone(&provider))
                .build()
                .map_err(|e| TlsError::Config(e.to_string()))?;
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| TlsError::Config(e.to_string()))?;
        tls.alpn_protocols = vec![alpn.to_vec()];
        Ok(tls)
    }

    /// A QUIC server configuration with `transport` ([`crate::paths`]) that requires a client certificate from the
    /// cluster CA.
    pub fn quic_server(&self, transport: Arc<quinn::TransportConfig>) -> Result<quinn::ServerConfig, TlsError> {
        let tls = self.tls_server(ALPN)?;
        let crypto =
            quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| TlsError::Config(e.to_string()))?;
        let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        config.transport_config(transport);
        Ok(config)
    }

    /// A QUIC client configuration with `transport` ([`crate::paths`]) that presents this identity and trusts only
    /// the cluster CA.
    pub fn quic_client(&self, transport: Arc<quinn::TransportConfig>) -> Result<quinn::ClientConfig, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| TlsError::Config(e.to_string()))?;
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let crypto =
            quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| TlsError::Config(e.to_string()))?;
        let mut config = quinn::ClientConfig::new(Arc::new(crypto));
        config.transport_config(transport);
        Ok(config)
    }
}

/// Where a process's identity lives on disk (`dir` holds `ca.pem`, `<name>.pem` and `<name>.key`), so that it can be
/// read again when the files change: cert-manager or an operator rotates certificates under a running process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentityFiles {
    pub dir: PathBuf,
    pub name: String,
}

/// How often [`watch`] looks at the files: rotation is rare, a look is three `stat`s.
pub const WATCH_PERIOD: std::time::Duration = std::time::Duration::from_secs(2);

impl IdentityFiles {
    fn paths(&self) -> [PathBuf; 3] {
        [
            self.dir.join("ca.pem"),
            self.dir.join(format!("{}.pem", self.name)),
            self.dir.join(format!("{}.key", self.name)),
        ]
    }

    /// The files' modification times (through symbolic links, as Kubernetes swaps a Secret's files).
    fn stamp(&self) -> Vec<Option<std::time::SystemTime>> {
        self.paths().iter().map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok()).collect()
    }
}

/// Calls `apply` with the identity read again from `files` whenever they change, until the task is dropped or
/// aborted. A change that does not read as an identity (a rotation caught half-written, a bad file) is logged and
/// skipped: the identity in use stays until a good one is there.
pub async fn watch(files: IdentityFiles, mut apply: impl FnMut(Identity) + Send) {
    let mut seen = files.stamp();
    loop {
        tokio::time::sleep(WATCH_PERIOD).await;
        let now = files.stamp();
        if now == seen {
            continue;
        }
        match Identity::load(&files.dir, &files.name) {
            Ok(identity) => {
                seen = now;
                tracing::info!(dir = %files.dir.display(), name = %files.name, "certificates changed; now presenting the new ones");
                apply(identity);
            }
            Err(e) => tracing::warn!(error = %e, "certificates changed but cannot be read; keeping the ones in use"),
        }
    }
}
