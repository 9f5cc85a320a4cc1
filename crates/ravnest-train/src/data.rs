//! Datasets: the embedded digits data, CSV files, IDX (MNIST / Fashion-MNIST) files, and any
//! text file for the character model. Every dataset is split the same way: the last
//! `max(1, n/6)` rows are the test set (for text: the end of the file).

use std::io::Read;
use std::path::Path;

/// The digits data, embedded (see `data/ATTRIBUTION.md`).
pub const DIGITS_CSV_GZ: &[u8] = include_bytes!("../data/digits.csv.gz");

/// Samples as rows of `features` floats in [0, 1] with a class label.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// Name for reports.
    pub name: String,
    /// Row-major features, `len() * features` values.
    pub x: Vec<f32>,
    /// Labels.
    pub y: Vec<u32>,
    /// Features per sample.
    pub features: usize,
    /// Image side, when the features are a square image (for the CNN).
    pub side: Option<usize>,
    /// Number of classes.
    pub classes: usize,
    /// For text: the characters, class `k` is `vocab[k]` (empty otherwise).
    pub vocab: Vec<char>,
    /// A corpus on disk: its windows are the samples, read when a batch needs them (`x` and
    /// `y` are empty then).
    pub windows: Option<crate::corpus::Windows>,
}

pub use crate::load_error::DataError;

/// The order in which epoch `epoch` of a run seeded `seed` visits the `n` training samples:
/// global sample `s` of the run is row `epoch_order(seed, s / n, n)[s % n]`. A pure function
/// of (seed, epoch), so that every node, and a test's reference, draws the same.
pub fn epoch_order(seed: u64, epoch: u64, n: usize) -> Vec<u32> {
    use rand::SeedableRng;
    use rand::seq::SliceRandom;
    let mut rows: Vec<u32> = (0..n as u32).collect();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
        seed ^ epoch.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
    );
    rows.shuffle(&mut rng);
    rows
}

/// The file's bytes, decompressed when its name ends in `.gz`.
fn gunzip_if_gz(spec: &str, bytes: Vec<u8>) -> Result<Vec<u8>, DataError> {
    if !spec.ends_with(".gz") {
        return Ok(bytes);
    }
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(&bytes[..])
        .read_to_end(&mut out)
        .map_err(|e| err(spec, format!("not gzip: {e}")))?;
    Ok(out)
}

fn err(origin: &str, message: impl Into<String>) -> DataError {
    DataError {
        origin: origin.into(),
        message: message.into(),
    }
}

impl Dataset {
    /// Samples.
    pub fn len(&self) -> usize {
        match &self.windows {
            Some(w) => w.len(),
            None => self.y.len(),
        }
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A corpus's windows as a dataset of a model of `vocab` tokens.
    pub fn of_windows(name: &str, windows: crate::corpus::Windows, vocab: usize) -> Dataset {
        Dataset {
            name: name.rsplit('/').next().unwrap_or(name).to_string(),
            x: Vec::new(),
            y: Vec::new(),
            features: windows.width(),
            side: None,
            classes: vocab,
            vocab: Vec::new(),
            windows: Some(windows),
        }
    }

    /// Sample `r`'s values appended to `out`.
    pub fn row_into(&self, r: usize, out: &mut Vec<f32>) -> Result<(), DataError> {
        match &self.windows {
            Some(w) => w.read(r, out),
            None => {
                let f = self.features;
                out.extend_from_slice(&self.x[r * f..(r + 1) * f]);
                Ok(())
            }
        }
    }

    /// Samples `rows`' values, one after the other.
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Result<Vec<f32>, DataError> {
        let mut out = Vec::with_capacity(rows.len() * self.features);
        for r in rows {
            self.row_into(r, &mut out)?;
        }
        Ok(out)
    }

    /// Split into (train, test): the last `max(1, n/6)` rows are the test set.
    pub fn split(&self) -> (Dataset, Dataset) {
        let n = self.len();
        self.split_at(n - (n / 6).max(1).min(n.saturating_sub(1)))
    }

    /// Split into (train, test) with the last `fraction` of the rows (at least one) held out.
    pub fn split_fraction(&self, fraction: f64) -> (Dataset, Dataset) {
        let n = self.len();
        let test = ((n as f64 * fraction).ceil() as usize)
            .max(1)
            .min(n.saturating_sub(1));
        self.split_at(n - test)
    }

    /// (the first `cut` rows, the rest).
    fn split_at(&self, cut: usize) -> (Dataset, Dataset) {
        let n = self.len();
        if let Some(w) = &self.windows {
            let (a, b) = w.split_at(cut);
            return (
                Dataset {
                    windows: Some(a),
                    ..self.clone()
                },
                Dataset {
                    windows: Some(b),
                    ..self.clone()
                },
            );
        }
        let part = |a: usize, b: usize| Dataset {
            name: self.name.clone(),
            x: self.x[a * self.features..b * self.features].to_vec(),
            y: self.y[a..b].to_vec(),
            ..self.clone()
        };
        (part(0, cut), part(cut, n))
    }

    /// Load `"digits"` (embedded) or a path (`.csv`, `.csv.gz`, or an IDX images file).
    pub fn load(spec: &str) -> Result<Dataset, DataError> {
        if spec == "digits" {
            let mut text = String::new();
            flate2::read::GzDecoder::new(DIGITS_CSV_GZ)
                .read_to_string(&mut text)
                .map_err(|e| err("digits", e.to_string()))?;
            return parse_csv(&text, "digits", 16.0);
        }
        let path = Path::new(spec);
        let bytes = std::fs::read(path).map_err(|e| {
            err(
                spec,
                format!("cannot read the dataset: {e} (`dataset` is \"digits\" or a path)"),
            )
        })?;
        let bytes = gunzip_if_gz(spec, bytes)?;
        if bytes.len() >= 4 && bytes[0] == 0 && bytes[1] == 0 && bytes[2] == 0x08 {
            return load_idx(path, &bytes);
        }
        let text = String::from_utf8(bytes)
            .map_err(|_| err(spec, "neither a CSV text file nor an IDX file"))?;
        let max = text
            .lines()
            .flat_map(|l| l.split(',').rev().skip(1))
            .filter_map(|v| v.trim().parse::<f32>().ok())
            .fold(0.0f32, f32::max);
        parse_csv(&text, spec, if max > 1.0 { max } else { 1.0 })
    }
}

/// CSV: features then an integer label per row; features are divided by `scale`.
fn parse_csv(text: &str, origin: &str, scale: f32) -> Result<Dataset, DataError> {
    let mut x = Vec::new();
    let mut y = Vec::new();
    let mut features = None;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() < 2 {
            return Err(err(
                origin,
                format!("line {}: expected features then a label", i + 1),
            ));
        }
        let f = fields.len() - 1;
        match features {
            None => features = Some(f),
            Some(k) if k != f => {
                return Err(err(
                    origin,
                    format!("line {}: {f} features, earlier rows have {k}", i + 1),
                ));
            }
            _ => {}
        }
        for (j, v) in fields[..f].iter().enumerate() {
            let v: f32 = v.parse().map_err(|_| {
                err(
                    origin,
                    format!("line {}, column {}: `{v}` is not a number", i + 1, j + 1),
                )
            })?;
            x.push(v / scale);
        }
        let label: u32 = fields[f].parse().map_err(|_| {
            err(
                origin,
                format!(
                    "line {}: label `{}` is not a class number",
                    i + 1,
                    fields[f]
                ),
            )
        })?;
        y.push(label);
    }
    let features = features.ok_or_else(|| err(origin, "no rows"))?;
    if y.len() < 2 {
        return Err(err(origin, "needs at least 2 rows"));
    }
    let classes = *y.iter().max().expect("rows exist") as usize + 1;
    let side = (1..=features).find(|s| s * s == features);
    Ok(Dataset {
        name: origin.rsplit('/').next().unwrap_or(origin).to_string(),
        x,
        y,
        features,
        side,
        classes,
        vocab: Vec::new(),
        windows: None,
    })
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// IDX images (magic 0x00000803) with the labels file beside it (`...-images-idx3-ubyte` →
/// `...-labels-idx1-ubyte`).
fn load_idx(path: &Path, images: &[u8]) -> Result<Dataset, DataError> {
    let origin = path.display().to_string();
    if images.len() < 16 || be32(images, 0) != 0x0803 {
        return Err(err(&origin, "not an IDX images file (magic 0x00000803)"));
    }
    let (n, rows, cols) = (
        be32(images, 4) as usize,
        be32(images, 8) as usize,
        be32(images, 12) as usize,
    );
    let features = rows.saturating_mul(cols);
    if n.checked_mul(features).map(|b| b + 16) != Some(images.len()) {
        return Err(err(
            &origin,
            format!(
                "header says {n} images of {rows}x{cols}, the file has {} bytes",
                images.len()
            ),
        ));
    }
    let name = path.file_name().and_then(|f| f.to_str()).unwrap_or("");
    let label_name = name.replace("images-idx3", "labels-idx1");
    let label_path = path.with_file_name(&label_name);
    if label_name == name {
        return Err(err(
            &origin,
            "cannot tell the labels file's name (expected `*images-idx3*`)",
        ));
    }
    let mut labels = std::fs::read(&label_path)
        .map_err(|e| err(&label_path.display().to_string(), format!("labels: {e}")))?;
    if label_name.ends_with(".gz") {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&labels[..])
            .read_to_end(&mut out)
            .map_err(|e| err(&label_path.display().to_string(), e.to_string()))?;
        labels = out;
    }
    if labels.len() != n + 8 || be32(&labels, 0) != 0x0801 || be32(&labels, 4) as usize != n {
        return Err(err(
            &label_path.display().to_string(),
            format!("not an IDX labels file for {n} images"),
        ));
    }
    let x = images[16..].iter().map(|&b| f32::from(b) / 255.0).collect();
    let y: Vec<u32> = labels[8..].iter().map(|&b| u32::from(b)).collect();
    let classes = *y.iter().max().unwrap_or(&0) as usize + 1;
    Ok(Dataset {
        name: name.to_string(),
        x,
        y,
        features,
        side: (rows == cols).then_some(rows),
        classes,
        vocab: Vec::new(),
        windows: None,
    })
}

/// Most distinct characters a text may hold (the model's input and output width).
pub const MAX_VOCAB: usize = 512;

impl Dataset {
    /// A text file (UTF-8, optionally `.gz`) for the character model: sample `i` is the
    /// `context` characters before position `i + context` (as class numbers) and the character
    /// at it. Classes are the text's distinct characters in sorted order.
    pub fn load_text(spec: &str, context: usize) -> Result<Dataset, DataError> {
        let bytes = std::fs::read(spec).map_err(|e| {
            err(
                spec,
                format!("cannot read the text: {e} (`dataset` is a text file's path)"),
            )
        })?;
        let bytes = gunzip_if_gz(spec, bytes)?;
        let text = String::from_utf8(bytes).map_err(|e| {
            err(
                spec,
                format!(
                    "not UTF-8 text (byte {}): the character model reads text files",
                    e.utf8_error().valid_up_to()
                ),
            )
        })?;
        Dataset::text(&text, spec, context)
    }

    /// Any file as byte tokens for the GPT: windows of `seq + 1` bytes (the inputs, and the
    /// last byte only as a target), one every `seq / 2` bytes. `.gz` files are decompressed.
    pub fn load_bytes(spec: &str, seq: usize) -> Result<Dataset, DataError> {
        let bytes = std::fs::read(spec).map_err(|e| {
            err(
                spec,
                format!("cannot read the text: {e} (`dataset` is a text file's path)"),
            )
        })?;
        let bytes = gunzip_if_gz(spec, bytes)?;
        Dataset::bytes(&bytes, spec, seq)
    }

    /// Token ids as samples for a model of `vocab` tokens: windows of `seq + 1` tokens, one
    /// every `seq` (window i feeds tokens [i·seq, i·seq + seq) and predicts the next one of
    /// each: packed sequences, every token a target once).
    pub fn tokens(
        ids: &[u32],
        origin: &str,
        seq: usize,
        vocab: usize,
    ) -> Result<Dataset, DataError> {
        // At least 12 windows: 10 to train on and 2 held out.
        let need = 12 * seq + 1;
        if seq == 0 || ids.len() < need {
            return Err(err(
                origin,
                format!(
                    "{} tokens: too short for 12 samples of {} tokens (need at least {need})",
                    ids.len(),
                    seq + 1
                ),
            ));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(err(
                origin,
                format!("token {bad} is outside the model's vocabulary of {vocab}"),
            ));
        }
        let n = (ids.len() - 1) / seq;
        let mut x = Vec::with_capacity(n * (seq + 1));
        for i in 0..n {
            x.extend(ids[i * seq..i * seq + seq + 1].iter().map(|&t| t as f32));
        }
        Ok(Dataset {
            name: origin.rsplit('/').next().unwrap_or(origin).to_string(),
            x,
            y: vec![0; n],
            features: seq + 1,
            side: None,
            classes: vocab,
            vocab: Vec::new(),
            windows: None,
        })
    }

    /// [`Dataset::load_bytes`] on bytes already in memory.
    pub fn bytes(bytes: &[u8], origin: &str, seq: usize) -> Result<Dataset, DataError> {
        let stride = (seq / 2).max(1);
        // At least 12 windows: 10 to train on and 2 held out.
        let need = seq + 1 + 11 * stride;
        if seq == 0 || bytes.len() < need {
            return Err(err(
                origin,
                format!(
                    "{} bytes: too short for windows of {} tokens (need at least {need})",
                    bytes.len(),
                    seq + 1
                ),
            ));
        }
        let n = (bytes.len() - seq - 1) / stride + 1;
        let mut x = Vec::with_capacity(n * (seq + 1));
        for i in 0..n {
            x.extend(
                bytes[i * stride..i * stride + seq + 1]
                    .iter()
                    .map(|&b| f32::from(b)),
            );
        }
        Ok(Dataset {
            name: origin.rsplit('/').next().unwrap_or(origin).to_string(),
            x,
            y: vec![0; n],
            features: seq + 1,
            side: None,
            classes: 256,
            vocab: Vec::new(),
            windows: None,
        })
    }

    /// [`Dataset::load_text`] on text already in memory.
    pub fn text(text: &str, origin: &str, context: usize) -> Result<Dataset, DataError> {
        let chars: Vec<char> = text.chars().collect();
        let mut vocab = chars.clone();
        vocab.sort_unstable();
        vocab.dedup();
        if vocab.len() > MAX_VOCAB {
            return Err(err(
                origin,
                format!(
                    "{} distinct characters; the character model takes at most {MAX_VOCAB}",
                    vocab.len()
                ),
            ));
        }
        if context == 0 || chars.len() < context + 12 {
            return Err(err(
                origin,
                format!(
                    "{} characters: too short for a context of {context} (need at least {})",
                    chars.len(),
                    context + 12
                ),
            ));
        }
        let ids: Vec<u32> = chars
            .iter()
            .map(|c| vocab.binary_search(c).expect("in vocab") as u32)
            .collect();
        let n = ids.len() - context;
        let mut x = Vec::with_capacity(n * context);
        for i in 0..n {
            x.extend(ids[i..i + context].iter().map(|&k| k as f32));
        }
        Ok(Dataset {
            name: origin.rsplit('/').next().unwrap_or(origin).to_string(),
            x,
            y: ids[context..].to_vec(),
            features: context,
            side: None,
            classes: vocab.len(),
            vocab,
            windows: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_load_and_split() {
        let d = Dataset::load("digits").unwrap();
        assert_eq!(
            (d.len(), d.features, d.classes, d.side),
            (1797, 64, 10, Some(8))
        );
        assert!(d.x.iter().all(|v| (0.0..=1.0).contains(v)));
        let (tr, te) = d.split();
        assert_eq!((tr.len(), te.len()), (1498, 299));
    }

    #[test]
    fn bad_csv_names_the_line() {
        let e = parse_csv("1,2,3\n1,x,3\n", "f.csv", 1.0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "f.csv: line 2, column 2: `x` is not a number"
        );
        let e = parse_csv("1,2,3\n1,2\n", "f.csv", 1.0).unwrap_err();
        assert!(e.to_string().contains("line 2: 1 features"), "{e}");
    }

    #[test]
    fn missing_file_is_named() {
        let e = Dataset::load("/nonexistent/train.csv").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("/nonexistent/train.csv: cannot read"),
            "{e}"
        );
    }

    #[test]
    fn idx_round_trip() {
        let dir = std::env::temp_dir().join(format!("ravnest-idx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut img = vec![0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 2];
        img.extend([0, 255, 128, 0, 1, 2, 3, 4]);
        let mut lab = vec![0, 0, 8, 1, 0, 0, 0, 2];
        lab.extend([3, 7]);
        std::fs::write(dir.join("t-images-idx3-ubyte"), img).unwrap();
        std::fs::write(dir.join("t-labels-idx1-ubyte"), lab).unwrap();
        let d = Dataset::load(dir.join("t-images-idx3-ubyte").to_str().unwrap()).unwrap();
        assert_eq!((d.len(), d.features, d.classes, d.side), (2, 4, 8, Some(2)));
        assert_eq!(d.y, vec![3, 7]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn text_samples_are_context_then_next_character() {
        let d = Dataset::text("abcabcabcabcabcabc", "t", 3).unwrap();
        assert_eq!(d.vocab, vec!['a', 'b', 'c']);
        assert_eq!((d.features, d.classes, d.len()), (3, 3, 15));
        assert_eq!(&d.x[..6], &[0.0, 1.0, 2.0, 1.0, 2.0, 0.0]);
        assert_eq!(&d.y[..2], &[0, 1]);
        let (train, test) = d.split();
        assert_eq!((train.len(), test.len()), (13, 2));
        assert_eq!(test.vocab, d.vocab);
    }

    #[test]
    fn text_errors_name_the_file_and_the_problem() {
        let e = Dataset::text("short", "notes.txt", 16).unwrap_err();
        assert!(e.to_string().starts_with("notes.txt: 5 characters"), "{e}");
        let dir = std::env::temp_dir().join(format!("ravnest-text-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bin = dir.join("bin.txt");
        std::fs::write(&bin, [b'a', b'b', 0xff, 0xfe]).unwrap();
        let e = Dataset::load_text(bin.to_str().unwrap(), 2).unwrap_err();
        assert!(e.to_string().contains("not UTF-8 text (byte 2)"), "{e}");
        let e = Dataset::load_text("/nonexistent/book.txt", 2).unwrap_err();
        assert!(e.to_string().contains("cannot read the text"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
