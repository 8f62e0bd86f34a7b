//! How a [`Batch`] travels in the body of `POST /v1/ingest`: the one place that names the
//! encodings, their media types, and decodes and encodes them (the agent, the server, the
//! write-ahead log's replay and the benchmark all call these).
//!
//! - **JSON** (`application/json`, or no `Content-Type` at all): every sender that is not a
//!   perch agent, and agents talking to a server older than the binary encoding.
//! - **MessagePack** ([`MSGPACK_MEDIA_TYPE`]): what perch agents send by default. The same
//!   serde types as the JSON, so the structure is the JSON's, field for field: a struct is a
//!   map keyed by field name (as `rmp_serde::to_vec_named` writes it; a field left out takes
//!   its default as in JSON), an absent value is nil or a missing key, numbers are MessagePack
//!   integers or floats, a unit enum variant is its name as a string. Parsing it is several
//!   times cheaper than parsing the JSON (no decimal text to read back into floats), which is
//!   what the server spends most of its ingest CPU on otherwise.
//!
//! Either may be compressed (`Content-Encoding: zstd` or `gzip`); the server decompresses
//! before it decodes. `docs/ingest.md` specifies both for third-party senders.

use crate::Batch;
use serde::Deserialize;

/// The media type of a MessagePack batch.
pub const MSGPACK_MEDIA_TYPE: &str = "application/vnd.perch.batch+msgpack";
/// The media type of a JSON batch.
pub const JSON_MEDIA_TYPE: &str = "application/json";

/// The encodings a batch may be sent in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    Json,
    Msgpack,
}

/// A `Content-Type` the server does not take (answered 415); the message names the ones it
/// does.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "Content-Type {0:?} is not a telemetry batch encoding this server takes: send `application/json` (a JSON batch, also assumed when Content-Type is absent) or `application/vnd.perch.batch+msgpack` (the same batch as MessagePack)"
)]
pub struct UnsupportedMediaType(pub String);

/// Why a body is not a batch: the decoder's message, naming what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DecodeError(pub String);

impl Encoding {
    pub const ALL: [Encoding; 2] = [Encoding::Json, Encoding::Msgpack];

    /// The `Content-Type` a batch in this encoding is sent with.
    pub const fn media_type(self) -> &'static str {
        match self {
            Encoding::Json => JSON_MEDIA_TYPE,
            Encoding::Msgpack => MSGPACK_MEDIA_TYPE,
        }
    }

    /// A short name for logs, benchmarks and messages.
    pub const fn name(self) -> &'static str {
        match self {
            Encoding::Json => "json",
            Encoding::Msgpack => "msgpack",
        }
    }

    /// The encoding a request's `Content-Type` names. No `Content-Type` is JSON (what every
    /// sender sent before there was a choice); parameters (`; charset=utf-8`) are ignored and
    /// the type is matched without regard to case.
    pub fn from_content_type(value: Option<&str>) -> Result<Encoding, UnsupportedMediaType> {
        let Some(value) = value else {
            return Ok(Encoding::Json);
        };
        let essence = value.split(';').next().unwrap_or("").trim();
        Encoding::ALL
            .into_iter()
            .find(|e| e.media_type().eq_ignore_ascii_case(essence))
            .ok_or_else(|| UnsupportedMediaType(value.to_owned()))
    }

    /// The batch in `body`, refused with a message naming what is wrong: a syntax error, a
    /// field of the wrong type or unknown, a truncated body, bytes after the batch.
    pub fn decode(self, body: &[u8]) -> Result<Batch, DecodeError> {
        match self {
            Encoding::Json => serde_json::from_slice(body).map_err(|e| DecodeError(e.to_string())),
            Encoding::Msgpack => {
                let mut de = rmp_serde::Deserializer::new(std::io::Cursor::new(body));
                let Ok(batch) = Batch::deserialize(&mut de) else {
                    return Err(msgpack_error(body));
                };
                let used = de.position();
                if used != body.len() as u64 {
                    return Err(DecodeError(format!(
                        "MessagePack: {} bytes follow the batch (it ends at byte {used} of {}); send one batch per request",
                        body.len() as u64 - used,
                        body.len()
                    )));
                }
                Ok(batch)
            }
        }
    }

    /// `batch` in this encoding (uncompressed).
    pub fn encode(self, batch: &Batch) -> Result<Vec<u8>, String> {
        match self {
            Encoding::Json => serde_json::to_vec(batch).map_err(|e| e.to_string()),
            Encoding::Msgpack => rmp_serde::to_vec_named(batch).map_err(|e| e.to_string()),
        }
    }
}

/// What is wrong with a MessagePack body that does not decode: decoded again (only on this
/// path, so accepted batches pay nothing for it) with the path of the field it went wrong in.
fn msgpack_error(body: &[u8]) -> DecodeError {
    let mut de = rmp_serde::Deserializer::new(std::io::Cursor::new(body));
    let err = match serde_path_to_error::deserialize::<_, Batch>(&mut de) {
        Ok(_) => return DecodeError("MessagePack: the batch does not decode".into()),
        Err(e) => e,
    };
    let at = de.position();
    let path = err.path().to_string();
    let field = if path == "." {
        String::new()
    } else {
        format!("field `{path}`: ")
    };
    DecodeError(format!(
        "MessagePack: {field}{} (at byte {at} of {})",
        err.into_inner(),
        body.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GpuEvent, GpuIndex, GpuSample, HostSample, NodeId};

    fn batch() -> Batch {
        let mut b = Batch::new(NodeId::new("n1").expect("node"), 7);
        b.gpus.push(GpuSample {
            time_ms: 1_700_000_000_000,
            gpu: GpuIndex(3),
            uuid: "GPU-1".into(),
            model: "H100".into(),
            simulated: true,
            utilization_gpu_pct: Some(42.5),
            memory_used_bytes: Some(1 << 40),
            sm_clock_mhz: Some(1980),
            ..GpuSample::default()
        });
        let host: HostSample = serde_json::from_value(serde_json::json!({
            "time_ms": 1_700_000_000_000i64, "simulated": false, "load1": 0.5
        }))
        .expect("host");
        b.hosts.push(host);
        let event: GpuEvent = serde_json::from_value(serde_json::json!({
            "time_ms": 1_700_000_000_000i64, "gpu": 0, "uuid": "GPU-0", "simulated": true,
            "kind": "xid", "xid": 79
        }))
        .expect("event");
        b.gpu_events.push(event);
        b
    }

    #[test]
    fn both_encodings_round_trip_the_same_batch() {
        let b = batch();
        for e in Encoding::ALL {
            let bytes = e.encode(&b).expect("encode");
            assert_eq!(e.decode(&bytes).expect("decode"), b, "{e:?}");
        }
        // Smaller than the JSON, and keyed by field name.
        let json = Encoding::Json.encode(&b).expect("json");
        let msgpack = Encoding::Msgpack.encode(&b).expect("msgpack");
        assert!(
            msgpack.len() < json.len(),
            "{} >= {}",
            msgpack.len(),
            json.len()
        );
        assert!(msgpack.windows(4).any(|w| w == b"node"));
        // A unit variant is its name, as in the JSON.
        assert!(msgpack.windows(4).any(|w| w == b"\xa3xid"));
    }

    #[test]
    fn content_types_name_encodings_and_others_are_refused_naming_the_accepted_ones() {
        let of = Encoding::from_content_type;
        assert_eq!(of(None), Ok(Encoding::Json));
        assert_eq!(of(Some("application/json")), Ok(Encoding::Json));
        assert_eq!(
            of(Some("Application/JSON; charset=utf-8")),
            Ok(Encoding::Json)
        );
        assert_eq!(
            of(Some("application/vnd.perch.batch+msgpack")),
            Ok(Encoding::Msgpack)
        );
        let refused = of(Some("application/x-protobuf")).expect_err("refused");
        let message = refused.to_string();
        assert!(message.contains("application/x-protobuf"), "{message}");
        assert!(message.contains(JSON_MEDIA_TYPE), "{message}");
        assert!(message.contains(MSGPACK_MEDIA_TYPE), "{message}");
        assert!(of(Some("")).is_err());
    }

    /// Malformed bodies are refused with a message, never a panic: every truncation of a good
    /// body, random bytes, lengths far past the body, deep nesting, a second value after the
    /// batch, a field of the wrong type and an unknown field.
    #[test]
    fn malformed_msgpack_is_refused_with_a_message() {
        let good = Encoding::Msgpack.encode(&batch()).expect("encode");
        for cut in 0..good.len() {
            let err = Encoding::Msgpack
                .decode(&good[..cut])
                .expect_err("truncated");
            assert!(err.0.starts_with("MessagePack: "), "{err}");
        }
        // Deterministic pseudo-random bytes (xorshift).
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for len in [1usize, 7, 64, 4096] {
            for _ in 0..200 {
                let bytes: Vec<u8> = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x as u8
                    })
                    .collect();
                let _ = Encoding::Msgpack.decode(&bytes);
            }
        }
        // A map of 2^32-1 entries, an array of as many GPUs, a string of 4 GiB: refused without
        // reserving what they claim.
        for bytes in [
            &b"\xdf\xff\xff\xff\xff"[..],
            b"\x82\xa4node\xa2n1\xa4gpus\xdd\xff\xff\xff\xff",
            b"\x81\xa4node\xdb\xff\xff\xff\xffabc",
        ] {
            let err = Encoding::Msgpack.decode(bytes).expect_err("huge");
            assert!(err.0.starts_with("MessagePack: "), "{err}");
        }
        // 100,000 nested arrays where a batch's field is expected.
        let mut deep = b"\x81\xa4node".to_vec();
        deep.extend(std::iter::repeat_n(0x91u8, 100_000));
        assert!(Encoding::Msgpack.decode(&deep).is_err());
        let mut deep = vec![0x91u8; 100_000];
        deep.push(0xc0);
        assert!(Encoding::Msgpack.decode(&deep).is_err());
        // Two batches in one body.
        let mut two = good.clone();
        two.extend_from_slice(&good);
        let err = Encoding::Msgpack.decode(&two).expect_err("two");
        assert!(err.0.contains("bytes follow the batch"), "{err}");
        // A string where the sequence number goes, a float where a GPU's index goes; a field no
        // batch has. Each is named.
        let mut b = serde_json::to_value(batch()).expect("value");
        b["seq"] = "seven".into();
        let err = Encoding::Msgpack
            .decode(&rmp_serde::to_vec_named(&b).expect("encode"))
            .expect_err("wrong type");
        assert!(err.0.contains("field `seq`"), "{err}");
        let mut b = serde_json::to_value(batch()).expect("value");
        b["gpus"][0]["gpu"] = 1.5.into();
        let err = Encoding::Msgpack
            .decode(&rmp_serde::to_vec_named(&b).expect("encode"))
            .expect_err("wrong type");
        assert!(err.0.contains("field `gpus[0].gpu`"), "{err}");
        let mut b = serde_json::to_value(batch()).expect("value");
        b["colour"] = "red".into();
        let err = Encoding::Msgpack
            .decode(&rmp_serde::to_vec_named(&b).expect("encode"))
            .expect_err("unknown field");
        assert!(err.0.contains("colour"), "{err}");
    }
}
