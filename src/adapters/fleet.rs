//! The fleet's shared routing state: what travels between the sidecars of one
//! fleet. [`wire`] is the message format every sidecar publishes and checks
//! before anything reaches the core's [`crate::core::load::peer_ledger`].
//!
//! Not wired into `serve` yet: the NATS transport that carries these messages is
//! still to come.

pub mod wire;
