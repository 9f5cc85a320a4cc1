//! `ravnest relay`: a circuit relay for nodes behind NATs ([`ravnest_runtime::p2p`]). It prints
//! the address nodes put in `[cluster] relays` and serves until Ctrl-C or SIGTERM.

use std::net::SocketAddr;

use anyhow::{Context, Result};
use ravnest_runtime::p2p::{RelayServer, fresh_relay_key, relay_key};

/// `ravnest relay`'s arguments.
#[derive(clap::Args, Debug)]
pub struct RelayCmd {
    /// The address peers reach this machine at, with a port to open to them (TCP), e.g.
    /// 203.0.113.7:4001.
    #[arg(long, value_name = "HOST:PORT")]
    pub listen: SocketAddr,
    /// A phrase its identity (peer id) derives from: the same phrase, the same address for the
    /// nodes' files across restarts. Without it, a new identity every start.
    #[arg(long, value_name = "TEXT")]
    pub seed: Option<String>,
    /// Print each reservation and circuit as it comes.
    #[arg(long)]
    pub verbose: bool,
}

/// Run the relay.
pub fn relay_command(cmd: RelayCmd) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let key = match &cmd.seed {
            Some(s) => relay_key(s.as_bytes()),
            None => fresh_relay_key(),
        };
        let relay = RelayServer::bind(key, cmd.listen)
            .map_err(anyhow::Error::msg)
            .context("ravnest relay")?;
        println!("relay: {}", relay.addr());
        println!(
            "  nodes behind NATs: put it in the cluster file, [cluster] relays = [\"{}\"]",
            relay.addr()
        );
        println!("  it forwards ciphertext only (each connection is encrypted end to end)");
        let verbose = cmd.verbose;
        let serve = relay.serve(move |line| {
            if verbose {
                println!("{line}");
            }
        });
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = serve => {}
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        Ok(())
    })
}
