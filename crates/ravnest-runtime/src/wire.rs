//! The wire format of [`crate::tcp`]: length-prefixed frames, each a small bincode header plus
//! the envelope's tensor as raw little-endian `f32` bytes.
//!
//! ```text
//! frame   = len:u32le  body                  (len = body length, 8 ..= MAX_FRAME)
//! body    = hlen:u32le header[hlen] payload  (payload length a multiple of 4)
//! header  = bincode(from: Addr, to: Addr, envelope with its tensor emptied)
//! payload = the tensor (chunk, push, pull, state, shard or probe data), f32 little-endian
//! ```
//!
//! Decoding never panics and never trusts a length: a frame longer than the limit is refused
//! before anything is read, the header is decoded under a byte limit, and the body is read as it
//! arrives (a peer that announces a gigabyte and sends ten bytes costs ten bytes).

use tokio::io::{AsyncRead, AsyncReadExt};

use crate::msg::{Addr, Envelope};

/// Largest frame body accepted: 1 GiB (a 256M-element gradient chunk).
pub const MAX_FRAME: u32 = 1 << 30;

/// Largest header accepted (a `Work` with a 100,000-node ring fits).
pub const MAX_HEADER: u32 = 1 << 20;

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The announced length is over the limit or too short to be a frame.
    #[error("frame length {len} is outside 8..={max}")]
    Length {
        /// Announced length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// The header length does not fit the frame or the header limit.
    #[error("header length {0} does not fit the frame")]
    HeaderLength(u64),
    /// The header is not a valid envelope header.
    #[error("undecodable header: {0}")]
    Header(String),
    /// The payload is not a whole number of f32s, or present where the envelope has none.
    #[error("payload of {0} bytes does not fit the envelope")]
    Payload(u64),
    /// The connection closed or failed mid-frame.
    #[error("connection: {0}")]
    Io(String),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_limit::<{ MAX_HEADER as usize }>()
}

/// Where the tensor of an envelope goes back, if it has one.
fn payload_slot(env: &mut Envelope) -> Option<&mut Vec<f32>> {
    match env {
        Envelope::Chunk { chunk, .. } => Some(&mut chunk.data),
        Envelope::Push { data, .. } | Envelope::Pull { data, .. } => Some(data),
        Envelope::Probe { data, .. } => Some(data),
        Envelope::State { model, .. } | Envelope::Shard { model, .. } => Some(model),
        _ => None,
    }
}

/// Encode one frame (length prefix included).
pub fn encode(from: Addr, to: Addr, env: &Envelope) -> Vec<u8> {
    let head = env.clone_without_payload();
    let payload = payload_of(env);
    let header = bincode::serde::encode_to_vec((from, to, &head), config())
        .expect("an envelope header always encodes");
    let body_len = 4 + header.len() + 4 * payload.len();
    let mut out = Vec::with_capacity(4 + body_len);
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    extend_le(&mut out, payload);
    out
}

fn payload_of(env: &Envelope) -> &[f32] {
    match env {
        Envelope::Chunk { chunk, .. } => &chunk.data,
        Envelope::Push { data, .. } | Envelope::Pull { data, .. } => data,
        Envelope::Probe { data, .. } => data,
        Envelope::State { model, .. } | Envelope::Shard { model, .. } => model,
        _ => &[],
    }
}

impl Envelope {
    /// A copy with the tensor left out (cheap for bulk envelopes).
    fn clone_without_payload(&self) -> Envelope {
        let empty = Vec::new;
        match self {
            Envelope::Chunk {
                chunk,
                virtual_bytes,
            } => Envelope::Chunk {
                chunk: ravnest_core::ring::RingChunk {
                    epoch: chunk.epoch,
                    level: chunk.level,
                    phase: chunk.phase,
                    step: chunk.step,
                    chunk: chunk.chunk,
                    data: empty(),
                },
                virtual_bytes: *virtual_bytes,
            },
            Envelope::Push {
                epoch,
                rank,
                virtual_bytes,
                ..
            } => Envelope::Push {
                epoch: *epoch,
                rank: *rank,
                data: empty(),
                virtual_bytes: *virtual_bytes,
            },
            Envelope::Pull {
                epoch,
                virtual_bytes,
                ..
            } => Envelope::Pull {
                epoch: *epoch,
                data: empty(),
                virtual_bytes: *virtual_bytes,
            },
            Envelope::Probe { id, echo, .. } => Envelope::Probe {
                id: *id,
                data: empty(),
                echo: *echo,
            },
            Envelope::State {
                version,
                virtual_bytes,
                ..
            } => Envelope::State {
                version: *version,
                model: empty(),
                virtual_bytes: *virtual_bytes,
            },
            Envelope::Shard {
                step,
                layers,
                digest,
                ..
            } => Envelope::Shard {
                step: *step,
                layers: *layers,
                digest: *digest,
                model: empty(),
            },
            other => other.clone(),
        }
    }
}

/// Append `xs` as little-endian bytes (a plain copy on little-endian machines).
fn extend_le(out: &mut Vec<u8>, xs: &[f32]) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(xs));
    } else {
        for x in xs {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
}

/// Little-endian bytes (a multiple of 4) as f32s (a plain copy on little-endian machines).
fn from_le(bytes: &[u8]) -> Vec<f32> {
    if cfg!(target_endian = "little") {
        bytemuck::pod_collect_to_vec(bytes)
    } else {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }
}

/// Decode a frame body (without its length prefix).
pub fn decode(body: &[u8]) -> Result<(Addr, Addr, Envelope), WireError> {
    if body.len() < 4 {
        return Err(WireError::HeaderLength(body.len() as u64));
    }
    let hlen = u32::from_le_bytes([body[0], body[1], body[2], body[3]]);
    if hlen > MAX_HEADER || hlen as usize > body.len() - 4 {
        return Err(WireError::HeaderLength(u64::from(hlen)));
    }
    let header = &body[4..4 + hlen as usize];
    let payload = &body[4 + hlen as usize..];
    let ((from, to, mut env), used): ((Addr, Addr, Envelope), usize) =
        bincode::serde::decode_from_slice(header, config())
            .map_err(|e| WireError::Header(e.to_string()))?;
    if used != header.len() {
        return Err(WireError::Header(format!(
            "{} trailing header bytes",
            header.len() - used
        )));
    }
    if !payload.len().is_multiple_of(4) {
        return Err(WireError::Payload(payload.len() as u64));
    }
    match payload_slot(&mut env) {
        Some(slot) => {
            if !slot.is_empty() {
                return Err(WireError::Header("tensor inside the header".into()));
            }
            *slot = from_le(payload);
        }
        None if payload.is_empty() => {}
        None => return Err(WireError::Payload(payload.len() as u64)),
    }
    Ok((from, to, env))
}

/// Read one frame body from `r`. `Ok(None)` on a clean end of stream between frames.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u32,
) -> Result<Option<Vec<u8>>, WireError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(WireError::Io(e.to_string())),
    }
    let len = u32::from_le_bytes(len);
    if !(8..=max).contains(&len) {
        return Err(WireError::Length {
            len: u64::from(len),
            max: u64::from(max),
        });
    }
    // Reserve at most 64 MiB from the announced length (frames come from authenticated peers
    // only, but a bug should not cost a gigabyte); beyond that, grow with what arrives.
    let mut body = Vec::with_capacity((len as usize).min(64 << 20));
    let got = (&mut *r)
        .take(u64::from(len))
        .read_to_end(&mut body)
        .await
        .map_err(|e| WireError::Io(e.to_string()))?;
    if got != len as usize {
        return Err(WireError::Io(format!(
            "stream ended after {got} of {len} bytes"
        )));
    }
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ravnest_core::NodeId;
    use ravnest_core::ring::{Phase, RingChunk};

    use proptest::prelude::*;

    fn samples() -> Vec<Envelope> {
        vec![
            Envelope::Heartbeat,
            Envelope::Chunk {
                chunk: RingChunk {
                    epoch: 3,
                    level: 1,
                    phase: Phase::AllGather,
                    step: 2,
                    chunk: 1,
                    data: vec![1.5, -2.0, f32::MIN_POSITIVE],
                },
                virtual_bytes: 12,
            },
            Envelope::State {
                version: 9,
                model: vec![0.25; 1000],
                virtual_bytes: 4000,
            },
            Envelope::Abort { epoch: 7 },
            Envelope::Push {
                epoch: 1,
                rank: 2,
                data: vec![],
                virtual_bytes: 0,
            },
        ]
    }

    #[test]
    fn envelopes_round_trip() {
        for env in samples() {
            let frame = encode(Addr::Node(NodeId(1)), Addr::Coordinator, &env);
            let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
            assert_eq!(len, frame.len() - 4);
            let (from, to, back) = decode(&frame[4..]).unwrap();
            assert_eq!((from, to), (Addr::Node(NodeId(1)), Addr::Coordinator));
            assert_eq!(back, env);
        }
    }

    #[tokio::test]
    async fn oversized_length_is_refused_before_reading() {
        let mut bytes: &[u8] = &[0xff, 0xff, 0xff, 0x7f, 1, 2, 3];
        let e = read_frame(&mut bytes, MAX_FRAME).await.unwrap_err();
        assert!(matches!(e, WireError::Length { .. }), "{e}");
    }

    #[tokio::test]
    async fn a_short_stream_is_an_error_not_a_hang() {
        let mut bytes: &[u8] = &[100, 0, 0, 0, 1, 2, 3];
        let e = read_frame(&mut bytes, MAX_FRAME).await.unwrap_err();
        assert!(matches!(e, WireError::Io(_)), "{e}");
    }

    proptest! {
        /// Arbitrary bytes never panic the decoder; whatever decodes re-encodes to a frame that
        /// decodes to the same envelope.
        #[test]
        fn decode_arbitrary_bytes(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok((from, to, env)) = decode(&body) {
                let again = encode(from, to, &env);
                prop_assert_eq!(decode(&again[4..]).unwrap(), (from, to, env));
            }
        }

        /// Mutating one byte of a valid frame never panics the decoder.
        #[test]
        fn decode_mutated_frames(which in 0usize..5, pos in any::<usize>(), byte in any::<u8>()) {
            let env = &samples()[which];
            let mut frame = encode(Addr::Node(NodeId(0)), Addr::Node(NodeId(1)), env);
            let i = pos % frame.len();
            frame[i] = byte;
            let _ = decode(&frame[4..]);
        }

        /// A stream of arbitrary bytes read as frames: errors, never panics, and never holds
        /// more than it was sent.
        #[test]
        fn read_arbitrary_streams(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                let mut r: &[u8] = &bytes;
                while let Ok(Some(body)) = read_frame(&mut r, MAX_FRAME).await {
                    assert!(body.len() <= bytes.len());
                    let _ = decode(&body);
                }
            });
        }
    }
}
