//! Tandem's model engine: loads a Llama-family GGUF, tokenizes and renders chat templates, runs the forward pass
//! on CPU over a paged KV cache, and samples.
//!
//! The pieces, bottom up: [`gguf`] reads the file; [`model`] holds the weights; [`kv`] stores K/V in blocks;
//! [`forward`] computes a batch step ([`backend`]: on CPU, or modelled by a timing profile); [`sampling`] picks tokens; [`generate`] drives sequences to completion.

#![deny(unsafe_code)]

pub mod backend;
pub mod bench;
pub mod chat;
mod columns;
mod datetime;
pub mod fetch;
pub mod forward;
pub mod gbnf;
pub mod generate;
pub mod gguf;
pub mod grammar;
pub mod hf;
pub mod kernels;
pub mod kv;
mod kv_memory;
pub mod model;
pub mod parity;
pub mod q8;
pub mod sampling;
pub mod synth;
pub mod team;
pub mod text;
pub mod tiers;
pub mod tokenizer;
