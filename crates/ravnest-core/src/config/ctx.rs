//! The file being read, and the errors and checked figures that name a place in it.

use std::ops::Range;

use toml::Spanned;

use super::figures::Figure;
use super::types::ConfigError;

/// The file being read: its name (for errors) and its text (for line and column).
pub(super) struct Ctx<'a> {
    /// File name (or `<embedded>`).
    pub(super) origin: &'a str,
    /// The whole text, where spans point.
    pub(super) text: &'a str,
    /// Reads a model folder's `config.json` for `[model] from` (see [`super::ModelReader`]).
    pub(super) models: super::ModelReader<'a>,
}

impl Ctx<'_> {
    /// 1-based line and column of a span's start.
    fn loc(&self, span: &Range<usize>) -> (usize, usize) {
        let start = span.start.min(self.text.len());
        let before = &self.text[..start];
        let line = before.matches('\n').count() + 1;
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        (line, col)
    }

    /// An error at `span` (or at no place).
    pub(super) fn err(
        &self,
        span: Option<&Range<usize>>,
        message: impl Into<String>,
    ) -> ConfigError {
        ConfigError {
            origin: self.origin.to_string(),
            at: span.map(|s| self.loc(s)),
            message: message.into(),
            help: None,
        }
    }

    /// `v`, which must be greater than 0 and [sane](Figure::sane); else an error at its place.
    pub(super) fn positive<T: Figure>(&self, v: &Spanned<T>, what: &str) -> Result<T, ConfigError> {
        let x = *v.get_ref();
        // (NaN compares as nothing: it is not greater than 0.)
        if x.partial_cmp(&T::default()) != Some(std::cmp::Ordering::Greater) {
            return Err(self.err(
                Some(&v.span()),
                format!("`{what}` must be greater than 0, got {}", x.show()),
            ));
        }
        x.sane(what).map_err(|m| self.err(Some(&v.span()), m))
    }

    /// `v`, which must be [sane](Figure::sane) (an integer, so never negative).
    pub(super) fn count(&self, v: &Spanned<u64>, what: &str) -> Result<u64, ConfigError> {
        v.get_ref()
            .sane(what)
            .map_err(|m| self.err(Some(&v.span()), m))
    }

    /// `v`, which must be 0 or more and [sane](Figure::sane); else an error at its place.
    pub(super) fn non_negative(&self, v: &Spanned<f64>, what: &str) -> Result<f64, ConfigError> {
        let x = *v.get_ref();
        if x.is_nan() || x < 0.0 {
            return Err(self.err(
                Some(&v.span()),
                format!("`{what}` must be 0 or more, got {}", x.show()),
            ));
        }
        x.sane(what).map_err(|m| self.err(Some(&v.span()), m))
    }
}
