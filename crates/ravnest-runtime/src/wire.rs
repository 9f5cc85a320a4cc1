//! The wire format of the TCP transport: length-prefixed frames, each a small bincode header plus
//! the envelope's tensor as raw little-endian `f32` bytes.
//!
//! ```text
//! frame   = len:u32le  body                  (len = body length, 8 ..= MAX_FRAME)
//! body    = hlen:u32le header[hlen] payload  (payload length a multiple of 4)
//! header  = bincode(from: Addr, to: Addr, envelope with its tensor emptied)
//! payload = the tensor (collective piece, activations, state, shard or probe data), f32 LE,
//!           or packed (`ravnest_core::pack`) where a collective piece says so
//! ```
//!
//! Decoding never panics and never trusts a length: a frame longer than the limit is refused
//! before anything is read, the header is decoded under a byte limit, and the body is read as it
//! arrives (a peer that announces a gigabyte and sends ten bytes costs ten bytes).

use tokio::io::{AsyncRead, AsyncReadExt};

use ravnest_core::pack::{Packing, unpack};

use ravnest_protocol::msg::{Addr, Envelope};

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
    /// The payload is not a whole number of values (f32 or packed), or present where the
    /// envelope has none.
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

/// How the tensor of an envelope travels: `f32`, or packed where a collective piece's
/// values were rounded to a packing (it packs them without loss).
fn packing_of(env: &Envelope) -> Packing {
    match env {
        Envelope::Coll { packing, .. } => *packing,
        _ => Packing::Fp32,
    }
}

/// Where the tensor of an envelope lives, if it has one.
fn payload_slot(env: &mut Envelope) -> Option<&mut Vec<f32>> {
    match env {
        Envelope::Coll { msg, .. } => Some(msg.data_mut()),
        Envelope::Probe { data, .. }
        | Envelope::Activation { data, .. }
        | Envelope::ActivationGrad { data, .. } => Some(data),
        Envelope::State { model, .. } | Envelope::Shard { model, .. } => Some(model),
        _ => None,
    }
}

/// The tensor of an outgoing frame.
#[derive(Debug)]
pub enum Payload {
    /// `f32` values, already little-endian, moved out of the envelope (not copied).
    F32(Vec<f32>),
    /// Packed values.
    Packed(Vec<u8>),
}

/// One outgoing frame: the length prefix and header as bytes, and the tensor to be written
/// straight from its own memory.
#[derive(Debug)]
pub struct Frame {
    /// `len`, `hlen` and the header.
    pub head: Vec<u8>,
    /// The tensor.
    pub payload: Payload,
    /// Whether it is a collective's piece (synchronization traffic, counted apart).
    pub sync: bool,
}

impl Frame {
    /// Frame `env` (its tensor is moved, not copied).
    pub fn new(from: Addr, to: Addr, mut env: Envelope) -> Frame {
        let packing = packing_of(&env);
        let mut values = payload_slot(&mut env)
            .map(std::mem::take)
            .unwrap_or_default();
        let payload = if packing == Packing::Fp32 {
            if cfg!(target_endian = "big") {
                for x in &mut values {
                    *x = f32::from_bits(x.to_bits().to_le());
                }
            }
            Payload::F32(values)
        } else {
            Payload::Packed(ravnest_core::pack::pack(packing, &values))
        };
        let header = bincode::serde::encode_to_vec((from, to, &env), config())
            .expect("an envelope header always encodes");
        let mut frame = Frame {
            head: Vec::new(),
            payload,
            sync: matches!(env, Envelope::Coll { .. }),
        };
        let body_len = 4 + header.len() + frame.payload_bytes().len();
        let mut head = Vec::with_capacity(8 + header.len());
        head.extend_from_slice(&(body_len as u32).to_le_bytes());
        head.extend_from_slice(&(header.len() as u32).to_le_bytes());
        head.extend_from_slice(&header);
        frame.head = head;
        frame
    }

    /// Bytes on the wire, length prefix included.
    pub fn len(&self) -> usize {
        self.head.len() + self.payload_bytes().len()
    }

    /// Whether the frame is empty (never: a frame has at least its prefixes).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tensor as bytes.
    pub fn payload_bytes(&self) -> &[u8] {
        match &self.payload {
            Payload::F32(v) => bytemuck::cast_slice(v),
            Payload::Packed(b) => b,
        }
    }

    /// The whole frame in one buffer (tests and small messages).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        out.extend_from_slice(&self.head);
        out.extend_from_slice(self.payload_bytes());
        out
    }
}

/// Encode one frame (length prefix included) into one buffer.
pub fn encode(from: Addr, to: Addr, env: &Envelope) -> Vec<u8> {
    Frame::new(from, to, env.clone()).to_bytes()
}

/// Decode a header and check that a payload of `payload_len` bytes fits its envelope.
fn decode_header(header: &[u8], payload_len: usize) -> Result<(Addr, Addr, Envelope), WireError> {
    let ((from, to, mut env), used): ((Addr, Addr, Envelope), usize) =
        bincode::serde::decode_from_slice(header, config())
            .map_err(|e| WireError::Header(e.to_string()))?;
    if used != header.len() {
        return Err(WireError::Header(format!(
            "{} trailing header bytes",
            header.len() - used
        )));
    }
    if packing_of(&env).values_in(payload_len).is_none() {
        return Err(WireError::Payload(payload_len as u64));
    }
    match payload_slot(&mut env) {
        Some(slot) if !slot.is_empty() => Err(WireError::Header("tensor inside the header".into())),
        None if payload_len != 0 => Err(WireError::Payload(payload_len as u64)),
        _ => Ok((from, to, env)),
    }
}

/// Put unpacked values (native order) into the envelope's tensor slot.
fn put(env: &mut Envelope, values: Vec<f32>) {
    if let Some(slot) = payload_slot(env) {
        *slot = values;
    }
}

/// Put `payload` (little-endian f32s) into the envelope's tensor slot.
fn fill(env: &mut Envelope, mut payload: Vec<f32>) {
    if cfg!(target_endian = "big") {
        for x in &mut payload {
            *x = f32::from_bits(u32::from_le(x.to_bits()));
        }
    }
    if let Some(slot) = payload_slot(env) {
        *slot = payload;
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
    let (from, to, mut env) = decode_header(header, payload.len())?;
    match packing_of(&env) {
        Packing::Fp32 => fill(&mut env, bytemuck::pod_collect_to_vec(payload)),
        p => put(
            &mut env,
            unpack(p, payload).map_err(|_| WireError::Payload(payload.len() as u64))?,
        ),
    }
    Ok((from, to, env))
}

/// Tensor bytes read (and allocated) at a time: memory follows what arrives, not what a length
/// announces.
const READ_STEP_ELEMS: usize = 4 << 20;

fn io(e: std::io::Error) -> WireError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        WireError::Io("stream ended mid-frame".into())
    } else {
        WireError::Io(e.to_string())
    }
}

/// Read one envelope from `r`: prefixes, header, then the tensor straight into its `f32`
/// buffer (no intermediate byte copy). `Ok(None)` on a clean end of stream between frames.
pub async fn read_envelope<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u32,
) -> Result<Option<(Addr, Addr, Envelope)>, WireError> {
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
    let mut hlen = [0u8; 4];
    r.read_exact(&mut hlen).await.map_err(io)?;
    let hlen = u32::from_le_bytes(hlen);
    if hlen > MAX_HEADER || hlen > len - 4 {
        return Err(WireError::HeaderLength(u64::from(hlen)));
    }
    let mut header = Vec::with_capacity((hlen as usize).min(4096));
    let got = (&mut *r)
        .take(u64::from(hlen))
        .read_to_end(&mut header)
        .await
        .map_err(io)?;
    if got != hlen as usize {
        return Err(WireError::Io("stream ended mid-frame".into()));
    }
    let payload_len = (len - 4 - hlen) as usize;
    let (from, to, mut env) = decode_header(&header, payload_len)?;
    let packing = packing_of(&env);
    if packing != Packing::Fp32 {
        let mut bytes: Vec<u8> = Vec::new();
        while bytes.len() < payload_len {
            let at = bytes.len();
            bytes.resize(at + (payload_len - at).min(4 * READ_STEP_ELEMS), 0);
            r.read_exact(&mut bytes[at..]).await.map_err(io)?;
        }
        let values = unpack(packing, &bytes).map_err(|_| WireError::Payload(payload_len as u64))?;
        put(&mut env, values);
        return Ok(Some((from, to, env)));
    }
    let want = payload_len / 4;
    let mut data: Vec<f32> = Vec::new();
    while data.len() < want {
        let at = data.len();
        data.resize(at + (want - at).min(READ_STEP_ELEMS), 0.0);
        r.read_exact(bytemuck::cast_slice_mut(&mut data[at..]))
            .await
            .map_err(io)?;
    }
    fill(&mut env, data);
    Ok(Some((from, to, env)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ravnest_core::collective::{CollId, CollMsg};
    use ravnest_core::ring::{Phase, RingChunk};
    use ravnest_core::{LayerRange, NodeId};

    use proptest::prelude::*;

    fn samples() -> Vec<Envelope> {
        vec![
            Envelope::Heartbeat,
            Envelope::Coll {
                msg: CollMsg::Chunk(RingChunk {
                    id: CollId {
                        epoch: 3,
                        step: 11,
                        bucket: 2,
                    },
                    level: 1,
                    phase: Phase::AllGather,
                    step: 2,
                    chunk: 1,
                    seg: 4,
                    data: vec![1.5, -2.0, f32::MIN_POSITIVE],
                }),
                virtual_bytes: 12,
                packing: Packing::Fp32,
            },
            Envelope::Coll {
                msg: CollMsg::Pull {
                    id: CollId::epoch(4),
                    data: vec![1.5, -2.0, 0.25, 0.0],
                },
                virtual_bytes: 8,
                packing: Packing::Fp16,
            },
            Envelope::State {
                version: 9,
                model: vec![0.25; 1000],
                virtual_bytes: 4000,
                layers: Some(LayerRange::new(2, 5)),
            },
            Envelope::Halt { epoch: 7 },
            Envelope::Coll {
                msg: CollMsg::Push {
                    id: CollId::epoch(1),
                    rank: 2,
                    data: vec![],
                },
                virtual_bytes: 0,
                packing: Packing::Int8,
            },
            Envelope::Activation {
                epoch: 2,
                step: 5,
                micro: 1,
                data: vec![0.5; 33],
                virtual_bytes: 132,
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

    /// A packed piece (values a collective already rounded) travels in its packed size and
    /// comes back with the same bits, through a buffer and through a stream.
    #[tokio::test]
    async fn packed_pieces_travel_small_and_exact() {
        for (packing, bytes) in [(Packing::Int8, 1000 + 4), (Packing::Fp16, 2000)] {
            let mut data: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 - 50.3).collect();
            ravnest_core::pack::canon(packing, &mut data);
            let env = Envelope::Coll {
                msg: CollMsg::Pull {
                    id: CollId::epoch(2),
                    data,
                },
                virtual_bytes: 4000,
                packing,
            };
            let frame = Frame::new(Addr::Node(NodeId(0)), Addr::Node(NodeId(1)), env.clone());
            assert_eq!(frame.payload_bytes().len(), bytes);
            let whole = frame.to_bytes();
            assert_eq!(decode(&whole[4..]).unwrap().2, env);
            let mut r = whole.as_slice();
            let got = read_envelope(&mut r, MAX_FRAME).await.unwrap().unwrap();
            assert_eq!(got.2, env);
            // A length that no count of values packs to is refused (an odd fp16 length; an
            // int8 block of one exponent byte and no value).
            let mut cut = whole.clone();
            let drop = if packing == Packing::Fp16 {
                1
            } else {
                1004 - 772
            };
            cut.truncate(cut.len() - drop);
            let len = (cut.len() - 4) as u32;
            cut[..4].copy_from_slice(&len.to_le_bytes());
            assert!(decode(&cut[4..]).is_err());
        }
    }

    /// A layer range is two `u32`s on the wire, `start` then `end`: the same bytes as the pair
    /// it replaced, so nodes of either build understand each other.
    #[test]
    fn a_layer_range_has_the_bytes_of_a_pair() {
        fn bytes(v: impl serde::Serialize) -> Vec<u8> {
            bincode::serde::encode_to_vec(v, config()).unwrap()
        }
        let r = LayerRange::new(2, 300);
        assert_eq!(bytes(r), bytes((2u32, 300u32)));
        assert_eq!(bytes(Some(r)), bytes(Some((2u32, 300u32))));
        assert_eq!(bytes(vec![(r, 7u64)]), bytes(vec![(2u32, 300u32, 7u64)]));
        assert_eq!(bytes((NodeId(1), r)), bytes((1u32, 2u32, 300u32)));
    }

    #[tokio::test]
    async fn envelopes_round_trip_through_a_stream() {
        let mut stream = Vec::new();
        for env in samples() {
            stream.extend(encode(Addr::Node(NodeId(2)), Addr::Node(NodeId(0)), &env));
        }
        let mut r: &[u8] = &stream;
        for env in samples() {
            let (from, to, back) = read_envelope(&mut r, MAX_FRAME).await.unwrap().unwrap();
            assert_eq!((from, to), (Addr::Node(NodeId(2)), Addr::Node(NodeId(0))));
            assert_eq!(back, env);
        }
        assert_eq!(read_envelope(&mut r, MAX_FRAME).await.unwrap(), None);
    }

    #[tokio::test]
    async fn an_announced_tensor_that_never_comes_is_an_error() {
        let env = Envelope::State {
            version: 1,
            model: vec![1.0; 1000],
            virtual_bytes: 0,
            layers: None,
        };
        let frame = encode(Addr::Node(NodeId(1)), Addr::Node(NodeId(0)), &env);
        let mut r: &[u8] = &frame[..frame.len() - 7];
        let e = read_envelope(&mut r, MAX_FRAME).await.unwrap_err();
        assert!(matches!(e, WireError::Io(_)), "{e}");
    }

    #[tokio::test]
    async fn oversized_length_is_refused_before_reading() {
        let mut bytes: &[u8] = &[0xff, 0xff, 0xff, 0x7f, 1, 2, 3];
        let e = read_envelope(&mut bytes, MAX_FRAME).await.unwrap_err();
        assert!(matches!(e, WireError::Length { .. }), "{e}");
    }

    #[tokio::test]
    async fn a_short_stream_is_an_error_not_a_hang() {
        let mut bytes: &[u8] = &[100, 0, 0, 0, 1, 2, 3];
        let e = read_envelope(&mut bytes, MAX_FRAME).await.unwrap_err();
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
        fn decode_mutated_frames(which in 0usize..6, pos in any::<usize>(), byte in any::<u8>()) {
            let env = &samples()[which];
            let mut frame = encode(Addr::Node(NodeId(0)), Addr::Node(NodeId(1)), env);
            let i = pos % frame.len();
            frame[i] = byte;
            let _ = decode(&frame[4..]);
        }

        /// A stream of arbitrary bytes read as envelopes: errors, never panics, and never
        /// holds a tensor larger than it was sent.
        #[test]
        fn read_arbitrary_streams(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                let mut r: &[u8] = &bytes;
                while let Ok(Some((from, to, env))) = read_envelope(&mut r, MAX_FRAME).await {
                    let frame = Frame::new(from, to, env);
                    assert!(frame.payload_bytes().len() <= bytes.len());
                }
            });
        }

        /// A valid frame with one byte changed, read from a stream: never panics.
        #[test]
        fn read_mutated_streams(which in 0usize..6, pos in any::<usize>(), byte in any::<u8>()) {
            let env = &samples()[which];
            let mut frame = encode(Addr::Node(NodeId(0)), Addr::Node(NodeId(1)), env);
            let i = pos % frame.len();
            frame[i] = byte;
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                let mut r: &[u8] = &frame;
                let _ = read_envelope(&mut r, MAX_FRAME).await;
            });
        }
    }
}
