//! TensorBoard event files (`run --tensorboard DIR`): scalars as `tensorflow.Event` protocol
//! buffers in TFRecord framing, the format `tensorboard --logdir DIR` reads. No crate for it is
//! kept up (the ones on crates.io pull in a protobuf compiler and have not moved in years), and
//! the part we need is three small messages: written here, and checked against TensorBoard's own
//! reader where it is installed (`tests/view.rs`).
//!
//! A record is `u64 length (LE)`, `u32 masked CRC-32C of those 8 bytes`, the data, `u32 masked
//! CRC-32C of the data`. An `Event` is `wall_time` (1, double), `step` (2, int64),
//! `file_version` (3, string) or `summary` (5, message); a `Summary` repeats `value` (1), each
//! a `tag` (1, string) and a `simple_value` (2, float).

use std::io::Write;
use std::path::{Path, PathBuf};

/// TensorBoard's masked CRC-32C.
pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn bytes_field(out: &mut Vec<u8>, field: u64, b: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// One `Event`: its wall time, step and either the file version or scalars.
fn event(
    wall_time: f64,
    step: i64,
    file_version: Option<&str>,
    scalars: &[(&str, f32)],
) -> Vec<u8> {
    let mut e = Vec::new();
    varint(&mut e, (1 << 3) | 1);
    e.extend_from_slice(&wall_time.to_le_bytes());
    varint(&mut e, 2 << 3);
    varint(&mut e, step as u64);
    if let Some(v) = file_version {
        bytes_field(&mut e, 3, v.as_bytes());
    }
    if !scalars.is_empty() {
        let mut summary = Vec::new();
        for (tag, x) in scalars {
            let mut value = Vec::new();
            bytes_field(&mut value, 1, tag.as_bytes());
            varint(&mut value, (2 << 3) | 5);
            value.extend_from_slice(&x.to_le_bytes());
            bytes_field(&mut summary, 1, &value);
        }
        bytes_field(&mut e, 5, &summary);
    }
    e
}

/// `data` framed as one TFRecord.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut r = Vec::with_capacity(data.len() + 16);
    r.extend_from_slice(&len);
    r.extend_from_slice(&masked_crc(&len).to_le_bytes());
    r.extend_from_slice(data);
    r.extend_from_slice(&masked_crc(data).to_le_bytes());
    r
}

/// An open event file.
#[derive(Debug)]
pub struct EventWriter {
    file: std::fs::File,
    path: PathBuf,
}

impl EventWriter {
    /// A new event file in `dir` (made if missing), named as TensorBoard's writers name theirs.
    pub fn create(dir: &Path, wall_time: f64) -> std::io::Result<EventWriter> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "ravnest".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            wall_time as u64,
            std::process::id()
        ));
        let mut file = std::fs::File::create(&path)?;
        file.write_all(&record(&event(wall_time, 0, Some("brain.Event:2"), &[])))?;
        Ok(EventWriter { file, path })
    }

    /// Where it writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Scalars at `step`, written through (TensorBoard shows them as they come).
    pub fn scalars(&mut self, wall_time: f64, step: u64, s: &[(&str, f32)]) -> std::io::Result<()> {
        self.file
            .write_all(&record(&event(wall_time, step as i64, None, s)))?;
        self.file.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_is_tensorboards() {
        // As TensorBoard's `record_writer.masked_crc32c` printed them.
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
        assert_eq!(masked_crc(&3u64.to_le_bytes()), 0x0e49_99b0);
    }

    #[test]
    fn a_scalar_event_is_the_protobuf_tensorflow_writes() {
        // Bytes of `Event(wall_time=1.5, step=3, summary=Summary(value=[Value(tag="a",
        // simple_value=2.0)]))`.SerializeToString(), as TensorBoard's own protobuf classes
        // (tensorboard.compat.proto) printed it.
        let e = event(1.5, 3, None, &[("a", 2.0)]);
        let want: Vec<u8> = [
            &[0x09][..],
            &1.5f64.to_le_bytes(),
            &[0x10, 0x03, 0x2a, 0x0a, 0x0a, 0x08, 0x0a, 0x01, b'a', 0x15],
            &2.0f32.to_le_bytes(),
        ]
        .concat();
        assert_eq!(e, want);
        let r = record(&e);
        assert_eq!(&r[..8], &(e.len() as u64).to_le_bytes());
        assert_eq!(&r[12..12 + e.len()], &e[..]);
    }
}
