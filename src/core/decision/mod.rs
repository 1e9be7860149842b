//! The LookupRoute decision (contract §4, steps 1–10).

pub mod outcome;
pub mod request;
