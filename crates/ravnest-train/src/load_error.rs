//! The errors of files that cannot be read: a model or checkpoint file ([`LoadError`]), a
//! dataset ([`DataError`]); each names the file and what is wrong.

/// A checkpoint could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct LoadError {
    /// File.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

/// A dataset could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{origin}: {message}")]
pub struct DataError {
    /// File (or "digits").
    pub origin: String,
    /// What is wrong, with the line or offset where known.
    pub message: String,
}
