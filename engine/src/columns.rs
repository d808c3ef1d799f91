//! A matmul's output, token by token (`out[t * rows + r]`), written by parallel tasks that each own a range of
//! weight rows: a task's results land in place instead of in a buffer laid out weight row by weight row and
//! transposed afterwards. The ranges are handed out here, so no two tasks can write the same element.

#![allow(unsafe_code)]

use std::marker::PhantomData;

use crate::team::Team;

struct Columns<'a> {
    ptr: *mut f32,
    rows: usize,
    n: usize,
    _out: PhantomData<&'a mut [f32]>,
}

// SAFETY: the tasks write disjoint elements (each its own rows, enforced by `Part::set`), and nothing reads the
// output until they have all ended.
unsafe impl Sync for Columns<'_> {}

/// Weight rows `first..first + len` of the output: what one task writes.
pub struct Part<'c> {
    cols: &'c Columns<'c>,
    first: usize,
    len: usize,
}

impl Part<'_> {
    /// The first weight row of this part.
    pub fn first(&self) -> usize {
        self.first
    }

    /// How many weight rows this part has.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Sets the value of weight row `first + r` for activation row `t`.
    #[inline]
    pub fn set(&self, r: usize, t: usize, v: f32) {
        assert!(r < self.len && t < self.cols.n, "row {r} of {}, activation row {t} of {}", self.len, self.cols.n);
        // SAFETY: in bounds (`t < n`, `first + r < rows`, `out` holds `n * rows`), and row `first + r` belongs to
        // this part alone.
        unsafe { self.cols.ptr.add(t * self.cols.rows + self.first + r).write(v) }
    }
}

/// Runs `task` in parallel over the parts of `per_task` weight rows (the last one shorter) of `out`, which holds
/// `n` activation rows of `rows` values.
#[cfg(test)]
pub fn par_rows(team: &Team, out: &mut [f32], n: usize, rows: usize, per_task: usize, task: impl Fn(&Part<'_>) + Sync) {
    par_rows_each(team, &mut [Output { out, rows, per_task }], n, |_, part| task(part));
}

/// One of several outputs [`par_rows_each`] fills at once: `n` activation rows of `rows` values, handed out in
/// parts of `per_task` weight rows.
pub struct Output<'a> {
    pub out: &'a mut [f32],
    pub rows: usize,
    pub per_task: usize,
}

/// Runs `task(i, part)` on `team` for every part of every output `i`, in one parallel loop.
/// Matmuls that read the same activations (a layer's Q, K and V; its gate and up projections) then cost one
/// loop's start and end instead of one each: at decode that is a large share of a small matmul.
pub fn par_rows_each(team: &Team, outs: &mut [Output<'_>], n: usize, task: impl Fn(usize, &Part<'_>) + Sync) {
    let mut parts = Vec::new();
    let cols: Vec<(Columns<'_>, usize)> = outs
        .iter_mut()
        .enumerate()
        .map(|(i, o)| {
            assert!(o.out.len() >= n * o.rows, "the output holds {} values, not {n} × {}", o.out.len(), o.rows);
            let per_task = o.per_task.max(1);
            parts.extend((0..o.rows.div_ceil(per_task)).map(|k| (i, k * per_task)));
            (Columns { ptr: o.out.as_mut_ptr(), rows: o.rows, n, _out: PhantomData }, per_task)
        })
        .collect();
    team.for_each(parts.len(), |p| {
        let (i, first) = parts[p];
        let (cols, per_task) = &cols[i];
        task(i, &Part { cols, first, len: (*per_task).min(cols.rows - first) });
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_element_is_written_once_in_token_order() {
        let (n, rows) = (3, 70);
        let mut out = vec![f32::NAN; n * rows];
        par_rows(&Team::new(2, "test").expect("team"), &mut out, n, rows, 32, |part| {
            for r in 0..part.len() {
                for t in 0..n {
                    part.set(r, t, (t * 1000 + part.first() + r) as f32);
                }
            }
        });
        for (i, v) in out.iter().enumerate() {
            assert_eq!(*v, ((i / rows) * 1000 + i % rows) as f32);
        }
    }

    #[test]
    fn several_outputs_each_get_every_element_once() {
        let n = 2;
        let (mut a, mut b) = (vec![f32::NAN; n * 70], vec![f32::NAN; n * 5]);
        let mut outs = [Output { out: &mut a, rows: 70, per_task: 32 }, Output { out: &mut b, rows: 5, per_task: 2 }];
        par_rows_each(&Team::new(3, "test").expect("team"), &mut outs, n, |i, part| {
            for r in 0..part.len() {
                for t in 0..n {
                    part.set(r, t, (i * 10_000 + t * 1000 + part.first() + r) as f32);
                }
            }
        });
        for (i, (out, rows)) in [(&a, 70), (&b, 5)].into_iter().enumerate() {
            for (at, v) in out.iter().enumerate() {
                assert_eq!(*v, (i * 10_000 + (at / rows) * 1000 + at % rows) as f32);
            }
        }
    }

    #[test]
    #[should_panic(expected = "row 32 of 32")]
    fn a_part_cannot_write_past_its_rows() {
        let mut out = vec![0f32; 64];
        par_rows(&Team::serial(), &mut out, 1, 64, 32, |part| part.set(32, 0, 1.0));
    }
}
