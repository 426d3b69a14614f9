//! A tiny deterministic MLP (64 → 32 ReLU → 16) for the serving example: the
//! leader and the workers build the same weights from a seed, so the leader
//! can check every answer exactly (same operations in the same order give the
//! same bits).

/// The network.
#[derive(Debug, Clone)]
pub struct Mlp {
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
}

/// A small linear congruential generator: reproducible, good enough for
/// weights in [-0.5, 0.5).
fn lcg(state: &mut u64) -> f32 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
}

impl Mlp {
    /// Inputs per request.
    pub const INPUTS: usize = 64;
    /// Hidden units.
    pub const HIDDEN: usize = 32;
    /// Outputs per answer.
    pub const OUTPUTS: usize = 16;

    /// The network whose weights come from `seed`.
    pub fn new(seed: u64) -> Mlp {
        let mut s = seed;
        let mut take = |n: usize| (0..n).map(|_| lcg(&mut s)).collect::<Vec<f32>>();
        Mlp {
            w1: take(Self::INPUTS * Self::HIDDEN),
            b1: take(Self::HIDDEN),
            w2: take(Self::HIDDEN * Self::OUTPUTS),
            b2: take(Self::OUTPUTS),
        }
    }

    /// The input of request `id`.
    pub fn input(id: u64) -> Vec<f32> {
        let mut s = id.wrapping_add(0x5eed);
        (0..Self::INPUTS).map(|_| lcg(&mut s)).collect()
    }

    /// Runs the network on one input (of [`Mlp::INPUTS`] values; missing
    /// values count as 0).
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let hidden: Vec<f32> = (0..Self::HIDDEN)
            .map(|h| {
                let row = &self.w1[h * Self::INPUTS..(h + 1) * Self::INPUTS];
                let z = row.iter().zip(x).map(|(w, v)| w * v).sum::<f32>() + self.b1[h];
                z.max(0.0)
            })
            .collect();
        (0..Self::OUTPUTS)
            .map(|o| {
                let row = &self.w2[o * Self::HIDDEN..(o + 1) * Self::HIDDEN];
                row.iter().zip(&hidden).map(|(w, v)| w * v).sum::<f32>() + self.b2[o]
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_answers() {
        let (a, b) = (Mlp::new(7), Mlp::new(7));
        let x = Mlp::input(3);
        assert_eq!(a.forward(&x), b.forward(&x));
        assert_ne!(a.forward(&x), Mlp::new(8).forward(&x));
        assert_ne!(a.forward(&x), a.forward(&Mlp::input(4)));
        assert_eq!(a.forward(&x).len(), Mlp::OUTPUTS);
    }
}
