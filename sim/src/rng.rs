//! Seeded randomness for the simulator: SplitMix64 streams derived from (seed, stream id), so
//! that adding a node or a link does not shift anyone else's numbers.

/// A SplitMix64 generator (Steele, Lea, Flood 2014): tiny, fast, and stable across versions.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The stream `ids` of run `seed`.
    pub fn derive(seed: u64, ids: &[u64]) -> Self {
        let mut r = Rng(seed ^ 0x5151_5eed_0000_0000);
        for &id in ids {
            r.0 ^= id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            r.next_u64();
        }
        r
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_independent() {
        let a: Vec<u64> = (0..4).map(|_| Rng::derive(7, &[1, 2]).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(
            Rng::derive(7, &[1, 2]).next_u64(),
            Rng::derive(7, &[2, 1]).next_u64()
        );
        assert_ne!(
            Rng::derive(7, &[1]).next_u64(),
            Rng::derive(8, &[1]).next_u64()
        );
        let mut r = Rng::derive(1, &[]);
        assert!((0..1000).map(|_| r.unit()).all(|x| (0.0..1.0).contains(&x)));
    }
}
