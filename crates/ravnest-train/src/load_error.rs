//! The error of a model or checkpoint file that cannot be read: the file, and what is wrong.

/// A checkpoint could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct LoadError {
    /// File.
    pub path: String,
    /// What is wrong.
    pub message: String,
}
