//! The eviction score: pure functions of a header, the file size, whether the
//! checkpoint is superseded, and `now`. Lowest score is evicted first.

use crate::format::Header;

/// Hit counts halve every 6 hours of disuse.
pub const HIT_HALF_LIFE_S: f64 = 21600.0;
/// Decayed hit counts below this count as 0.
pub const MIN_EFFECTIVE_HITS: f64 = 0.01;
/// Multiplier for anchor reasons (cold, evict, shutdown).
pub const ANCHOR_FACTOR: f64 = 2.0;
/// Multiplier for a waypoint (`continued`, `turn-end`, `agent-session`) checkpoint whose text is a strict prefix of a checkpoint
/// created no earlier by the same model: the longer file already serves that
/// conversation, the shorter one only helps a branch.
pub const SUPERSEDED_FACTOR: f64 = 0.5;

/// `hits * 2^(-(now - used_at) / 21600)`, 0 when `used_at == 0` or below 0.01.
/// Timestamps in the future count as age 0.
pub fn effective_hits(hits: u32, used_at: u64, now: u64) -> f64 {
    if used_at == 0 || hits == 0 {
        return 0.0;
    }
    let age = now.saturating_sub(used_at) as f64;
    let eh = f64::from(hits) * (-age / HIT_HALF_LIFE_S).exp2();
    if eh < MIN_EFFECTIVE_HITS {
        0.0
    } else {
        eh
    }
}

/// `(effective_hits + 1) * tokens / file_bytes`, x[`ANCHOR_FACTOR`] for anchor reasons,
/// x[`SUPERSEDED_FACTOR`] for a superseded waypoint checkpoint. `used_at` is
/// `last_used`, or `created` when `last_used` is 0.
pub fn eviction_score(header: &Header, file_bytes: u64, superseded: bool, now: u64) -> f64 {
    let eh = effective_hits(header.hits, header.used_at(), now);
    let mut score = (eh + 1.0) * f64::from(header.tokens) / (file_bytes.max(1) as f64);
    if header.reason.is_anchor() {
        score *= ANCHOR_FACTOR;
    }
    if superseded && header.reason.is_waypoint() {
        score *= SUPERSEDED_FACTOR;
    }
    score
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{ModelId, SaveReason};

    fn h(reason: SaveReason, hits: u32, created: u64, last_used: u64, tokens: u32) -> Header {
        Header {
            reason,
            ext_flags: 0,
            tokens,
            hits,
            n_ctx: 1 << 20,
            created,
            last_used,
            text_bytes: 0,
            payload_bytes: 0,
            sections_bytes: 0,
            model: ModelId::default(),
            body_checksum: 0,
        }
    }

    #[test]
    fn decay() {
        assert_eq!(effective_hits(8, 1000, 1000), 8.0);
        assert_eq!(effective_hits(8, 1000, 1000 + 21600), 4.0);
        assert_eq!(effective_hits(8, 1000, 1000 + 3 * 21600), 1.0);
        assert_eq!(effective_hits(8, 0, 1_000_000), 0.0);
        // A timestamp in the future counts as age 0.
        assert_eq!(effective_hits(8, 2000, 1000), 8.0);
        // 1 * 2^-7 = 0.0078 < 0.01 -> 0; 1 * 2^-6 = 0.0156 stays.
        assert_eq!(effective_hits(1, 1, 1 + 7 * 21600), 0.0);
        assert_eq!(effective_hits(1, 1, 1 + 6 * 21600), 1.0 / 64.0);
    }

    #[test]
    fn formula() {
        let now = 1_000_000;
        let c = h(SaveReason::Continued, 3, 10, 0, 1000);
        // last_used 0 -> created; age huge -> hits count 0.
        assert_eq!(eviction_score(&c, 4000, false, now), 0.25);
        assert_eq!(eviction_score(&c, 4000, true, now), 0.125);
        let cold = h(SaveReason::Cold, 2, 0, now - 21600, 1000);
        assert_eq!(
            eviction_score(&cold, 4000, false, now),
            (1.0 + 1.0) * 0.25 * 2.0
        );
        // The superseded factor applies only to waypoints.
        assert_eq!(eviction_score(&cold, 4000, true, now), 1.0);
        let turn = h(SaveReason::TurnEnd, 3, 10, 0, 1000);
        assert_eq!(eviction_score(&turn, 4000, true, now), 0.125);
    }
}
