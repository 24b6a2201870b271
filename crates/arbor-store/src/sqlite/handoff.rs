//! The queue that hands jobs from the async side to the SQLite threads.
//!
//! It was `std::sync::mpsc`, whose sender wakes a sleeping receiver while
//! it still holds the lock the receiver takes first thing when it wakes.
//! With Arbor on one core the woken thread ran at once, found the lock
//! held, and slept again until the sender let go: every hand-off to an idle
//! store thread was three thread switches and two more `futex` calls
//! instead of one switch (seen under `strace` on every turn's writes). Here
//! the sender lets go of the lock before it wakes anyone, and wakes only a
//! thread that sleeps.
//!
//! A job may also be *quiet*: it does not wake a thread that sleeps with a
//! deadline (the writer holding deferred writes, which it commits when the
//! first of them is due; a quiet job goes with them). Only a thread asleep
//! with nothing to do is woken for it.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// The queue, shared by one [`Sender`] and the threads that take from it.
#[derive(Debug)]
pub(super) struct Handoff<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
}

#[derive(Debug)]
struct State<T> {
    items: VecDeque<T>,
    /// Threads asleep in [`Handoff::next`] without a deadline.
    idle: usize,
    /// Threads asleep with one.
    dozing: usize,
    /// The sender is gone: no more items will come.
    closed: bool,
}

impl<T> Default for State<T> {
    fn default() -> Self {
        State { items: VecDeque::new(), idle: 0, dozing: 0, closed: false }
    }
}

/// What [`Handoff::next`] found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Next<T> {
    Item(T),
    /// The deadline passed with the queue empty.
    TimedOut,
    /// The queue is empty and its sender gone.
    Closed,
}

impl<T> Handoff<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // Nothing runs under the lock that can panic half-way.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Takes the oldest item without waiting.
    pub fn try_next(&self) -> Option<T> {
        self.lock().items.pop_front()
    }

    /// Takes the oldest item, waiting for one until `deadline` (forever
    /// without one).
    pub fn next(&self, deadline: Option<Instant>) -> Next<T> {
        let mut state = self.lock();
        loop {
            if let Some(item) = state.items.pop_front() {
                return Next::Item(item);
            }
            if state.closed {
                return Next::Closed;
            }
            match deadline {
                None => {
                    state.idle += 1;
                    state = self.ready.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
                    state.idle -= 1;
                }
                Some(deadline) => {
                    let Some(left) = deadline.checked_duration_since(Instant::now()).filter(|left| !left.is_zero())
                    else {
                        return Next::TimedOut;
                    };
                    state.dozing += 1;
                    state = self.ready.wait_timeout(state, left).unwrap_or_else(|poisoned| poisoned.into_inner()).0;
                    state.dozing -= 1;
                }
            }
        }
    }

    fn push(&self, item: T, quiet: bool) {
        let mut state = self.lock();
        if state.closed {
            // Its thread is gone (see `abandon`): dropped, the item's
            // caller hears that nobody will answer.
            return;
        }
        state.items.push_back(item);
        let wake = state.idle > 0 || (!quiet && state.dozing > 0);
        drop(state);
        if wake {
            self.ready.notify_one();
        }
    }

    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// For the one thread that takes from the queue, when it stops for
    /// good (it panicked): drops what is queued and what comes after, so
    /// that no caller waits for an answer that will never come.
    pub fn abandon(&self) {
        let items = {
            let mut state = self.lock();
            state.closed = true;
            std::mem::take(&mut state.items)
        };
        drop(items);
    }
}

/// The sending side. Clones share the queue, which closes when the last
/// of them is dropped.
pub(super) struct Sender<T>(Arc<Closing<T>>);

/// Closes the queue when dropped.
struct Closing<T>(Arc<Handoff<T>>);

impl<T> Drop for Closing<T> {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        Sender(self.0.clone())
    }
}

impl<T> std::fmt::Debug for Sender<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Sender").finish_non_exhaustive()
    }
}

impl<T> Sender<T> {
    /// A new queue: its sender, and the side the threads take from.
    pub fn new() -> (Sender<T>, Arc<Handoff<T>>) {
        let queue = Arc::new(Handoff { state: Mutex::new(State::default()), ready: Condvar::new() });
        (Sender(Arc::new(Closing(queue.clone()))), queue)
    }

    /// Queues `item`, waking a thread that sleeps.
    pub fn send(&self, item: T) {
        self.0.0.push(item, false);
    }

    /// Queues `item`, waking only a thread that sleeps with nothing to do.
    pub fn send_quiet(&self, item: T) {
        self.0.0.push(item, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Runs `next` on a thread of its own and says what it got and when.
    fn taker(queue: &Arc<Handoff<u32>>, deadline: Option<Instant>) -> std::thread::JoinHandle<(Next<u32>, Instant)> {
        let queue = queue.clone();
        std::thread::spawn(move || {
            let next = queue.next(deadline);
            (next, Instant::now())
        })
    }

    /// Waits until `count` threads sleep in the queue (with a deadline when
    /// `dozing`).
    fn until_asleep(queue: &Handoff<u32>, count: usize, dozing: bool) {
        let started = Instant::now();
        loop {
            let state = queue.lock();
            if (if dozing { state.dozing } else { state.idle }) == count {
                return;
            }
            drop(state);
            assert!(started.elapsed() < Duration::from_secs(10), "the takers never slept");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn items_come_out_in_order_and_a_sleeping_taker_wakes_for_one() {
        let (sender, queue) = Sender::new();
        sender.send(1);
        sender.send_quiet(2);
        assert_eq!(queue.try_next(), Some(1));
        assert_eq!(queue.next(None), Next::Item(2));
        assert_eq!(queue.try_next(), None);

        let waiting = taker(&queue, None);
        until_asleep(&queue, 1, false);
        // Quiet or not, a thread with nothing to do is woken.
        sender.send_quiet(3);
        assert_eq!(waiting.join().expect("taker").0, Next::Item(3));

        // Several takers: each item wakes one, none is lost.
        let takers: Vec<_> = (0..3).map(|_| taker(&queue, None)).collect();
        until_asleep(&queue, 3, false);
        for item in [10, 11, 12] {
            sender.send(item);
        }
        let mut got: Vec<u32> = takers
            .into_iter()
            .map(|taker| match taker.join().expect("taker").0 {
                Next::Item(item) => item,
                other => panic!("{other:?}"),
            })
            .collect();
        got.sort();
        assert_eq!(got, [10, 11, 12]);
    }

    #[test]
    fn a_quiet_item_waits_for_a_dozing_takers_deadline_and_a_loud_one_does_not() {
        let (sender, queue) = Sender::new();
        let deadline = Instant::now() + Duration::from_millis(300);
        let dozing = taker(&queue, Some(deadline));
        until_asleep(&queue, 1, true);
        sender.send_quiet(1);
        let (next, at) = dozing.join().expect("taker");
        // Woken at its deadline (or by chance a little earlier, spuriously),
        // it finds the item.
        assert_eq!(next, Next::Item(1));
        assert!(at + Duration::from_millis(100) >= deadline, "a quiet item woke the dozing taker");

        let sent = Instant::now();
        let dozing = taker(&queue, Some(Instant::now() + Duration::from_secs(30)));
        until_asleep(&queue, 1, true);
        sender.send(2);
        let (next, at) = dozing.join().expect("taker");
        assert_eq!(next, Next::Item(2));
        assert!(at.duration_since(sent) < Duration::from_secs(10), "the item woke it long before its deadline");
    }

    #[test]
    fn an_abandoned_queue_drops_what_it_holds_and_what_comes_after() {
        let (sender, queue) = Sender::new();
        let (first, second) = (Arc::new(1), Arc::new(2));
        sender.send(first.clone());
        queue.abandon();
        sender.send(second.clone());
        assert_eq!((Arc::strong_count(&first), Arc::strong_count(&second)), (1, 1), "nothing kept");
        assert_eq!(queue.try_next(), None);
    }

    #[test]
    fn an_empty_queue_times_out_and_closes_once_drained() {
        let (sender, queue) = Sender::new();
        assert_eq!(queue.next(Some(Instant::now() + Duration::from_millis(5))), Next::TimedOut);
        assert_eq!(queue.next(Some(Instant::now())), Next::TimedOut, "a deadline already past");

        // A clone keeps the queue open after the first sender goes.
        let clone = sender.clone();
        drop(sender);
        let waiting = taker(&queue, None);
        until_asleep(&queue, 1, false);
        clone.send(7);
        drop(clone);
        // What was queued before the sender went is still taken.
        assert_eq!(waiting.join().expect("taker").0, Next::Item(7));
        let waiting = taker(&queue, None);
        assert_eq!(waiting.join().expect("taker").0, Next::Closed);
        assert_eq!(queue.next(None), Next::Closed);
    }
}
