//! The threads that own the SQLite connections.
//!
//! SQLite's API is blocking. A connection lives on a thread of its own and
//! the async side hands it whole jobs — a closure that runs every statement
//! of one store call, transaction included — and awaits one reply. A turn's
//! write is then one hand-off each way, however many statements it holds;
//! with a connection that crosses threads per statement (as sqlx's does) the
//! same write was a dozen, and those switches were most of Arbor's time in
//! the benchmark's profile (bench/REPORT.md).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use rusqlite::Connection;
use tokio::sync::oneshot;

use crate::{StoreError, StoreResult};

type Job = Box<dyn FnOnce(&mut Connection) + Send>;

/// A queue of jobs served by one or more threads, each with its own
/// connection. Cloning shares the queue; the threads stop (closing their
/// connections) once every clone is gone and the queue is drained.
#[derive(Clone, Debug)]
pub(super) struct Workers {
    jobs: mpsc::Sender<Job>,
}

impl Workers {
    /// Starts one thread per connection, all taking jobs from one queue in
    /// arrival order.
    pub fn start(name: &str, connections: Vec<Connection>) -> std::io::Result<Workers> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        for (index, mut connection) in connections.into_iter().enumerate() {
            let queue = queue.clone();
            std::thread::Builder::new().name(format!("{name}-{index}")).spawn(move || {
                loop {
                    // The lock is held only while waiting for the next job:
                    // the other threads queue for it, and one of them takes
                    // the job after.
                    let job = match queue.lock() {
                        Ok(queue) => queue.recv(),
                        Err(_) => return,
                    };
                    let Ok(job) = job else { return };
                    // A panicking job (a bug) loses its own reply, which its
                    // caller sees as an error; the thread serves on.
                    let _ = catch_unwind(AssertUnwindSafe(|| job(&mut connection)));
                }
            })?;
        }
        Ok(Workers { jobs })
    }

    /// Runs `job` on one of the threads and returns its result.
    pub async fn run<T, F>(&self, job: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> StoreResult<T> + Send + 'static,
    {
        let (reply, result) = oneshot::channel();
        self.jobs
            .send(Box::new(move |connection: &mut Connection| {
                // The caller may have stopped waiting (a cancelled request):
                // the work is done all the same, only the answer is dropped.
                let _ = reply.send(job(connection));
            }))
            .map_err(|_| closed())?;
        result.await.map_err(|_| closed())?
    }
}

fn closed() -> StoreError {
    StoreError::Database("the SQLite connection thread did not answer".into())
}
