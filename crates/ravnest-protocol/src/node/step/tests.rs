use proptest::prelude::*;

use super::*;

/// `n` buckets of sizes 1, 2, 3, ... laid end to end.
fn targets(n: usize) -> Vec<Range<usize>> {
    let mut at = 0;
    (0..n)
        .map(|k| {
            let r = at..at + k + 1;
            at = r.end;
            r
        })
        .collect()
}

fn id(bucket: u32) -> CollId {
    CollId {
        epoch: 2,
        step: 9,
        bucket,
    }
}

#[test]
fn a_result_of_another_size_or_bucket_is_refused_or_ignored() {
    let c = Collect::new((2, 9), StepMode::Sync, None, targets(2), false);
    assert!(c.owns(id(0)) && !c.owns(CollId { step: 8, ..id(0) }));
    let e = c.arrived(id(1), 3).unwrap_err();
    assert!(e.contains("step 9 bucket 1 gave 3 values for 2"), "{e}");
    assert_eq!(c.arrived(id(2), 1), Ok(None));
    // Not sharded, the gather bit is no gather: an unknown bucket.
    assert_eq!(c.arrived(id(GATHER), 1), Ok(None));
}

#[test]
fn a_merge_waits_for_its_rounds_sum_alone() {
    let mut c = Collect::waiting((2, 9), StepMode::Merge, None, 1);
    assert!(!c.settled());
    assert_eq!(c.arrived(id(0), 4), Ok(None), "no bucket of its own");
    c.landed();
    assert!(c.settled());
}

/// Run a step of `n` buckets, sharded or not, clipped or not, its results coming back in the
/// order `picks` chooses among those under way (a sharded bucket's all-gather starts once its
/// reduce-scatter was applied; clipped, once every bucket is held). Every result is applied
/// once, exactly one is the first, and the step settles after the last one and not before.
fn run(n: usize, sharded: bool, clipped: bool, picks: &[usize]) {
    let t = targets(n);
    let mut c = Collect::new((2, 9), StepMode::Sync, None, t.clone(), sharded);
    let mut flight: Vec<u32> = (0..n as u32).collect();
    let (mut firsts, mut applied) = (0, Vec::new());
    let mut pick = picks.iter().cycle();
    while !flight.is_empty() {
        assert!(!c.settled(), "settled with {flight:?} under way");
        let i = pick.next().copied().unwrap_or(0) % flight.len();
        let b = flight.remove(i);
        let k = (b & !GATHER) as usize;
        match c.arrived(id(b), t[k].len()).unwrap().unwrap() {
            Arrival::Reduced {
                bucket,
                target,
                first,
            } => {
                assert_eq!((bucket as usize, &target), (k, &t[k]));
                firsts += usize::from(first);
                if clipped {
                    c.hold(bucket, vec![1.0; target.len()]);
                    let sum: usize = c.held().map(|(r, v)| r.len().min(v.len())).sum();
                    assert!(sum <= t.iter().map(|r| r.len()).sum());
                    if c.all_held() {
                        for (bucket, target, values) in c.take_held() {
                            assert_eq!(target.len(), values.len());
                            applied.push(bucket);
                            if sharded {
                                flight.push(bucket | GATHER);
                            }
                        }
                    }
                } else {
                    applied.push(bucket);
                    c.landed();
                    if sharded {
                        flight.push(bucket | GATHER);
                    }
                }
            }
            Arrival::Gathered { bucket, target } => {
                assert!(sharded);
                assert_eq!(target, t[bucket as usize]);
                applied.push(bucket | GATHER);
                c.landed();
            }
        }
    }
    assert!(c.settled(), "every result is in");
    assert_eq!(firsts, 1, "one first result");
    applied.sort_unstable();
    let mut want: Vec<u32> = (0..n as u32).collect();
    if sharded {
        want.extend((0..n as u32).map(|k| k | GATHER));
    }
    assert_eq!(applied, want, "every result applied once");
}

#[test]
fn a_clipped_sharded_step_settles_after_its_gathers() {
    run(3, true, true, &[2, 0, 1]);
    run(1, false, false, &[0]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_result_lands_once_in_any_order(
        n in 1usize..6,
        sharded: bool,
        clipped: bool,
        picks in proptest::collection::vec(0usize..8, 1..12),
    ) {
        run(n, sharded, clipped, &picks);
    }
}
