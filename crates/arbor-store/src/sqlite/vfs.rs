//! A thin layer over SQLite's own unix VFS that writes each commit's WAL
//! frames with one `pwrite` instead of two per frame.
//!
//! SQLite appends a frame to the WAL as two writes: the 24-byte frame
//! header, then the page. A JSON turn's two durable commits write ~20
//! frames, so the writer thread made ~43 `pwrite` calls a turn at 1,000
//! turns/s (`perf stat`, bench/analysis.md), and on this VM twenty small
//! writes cost ~3× the CPU of one write of the same bytes.
//!
//! Here a WAL file keeps contiguous appends in a buffer and writes them in
//! one call before anything can depend on them:
//! - before any other operation on the same WAL file (read, sync,
//!   truncate, size, file control, close);
//! - before the commit is published to other connections. SQLite publishes
//!   a commit by writing the WAL index header in shared memory, with a
//!   memory barrier (`xShmBarrier` on the database file) between the two
//!   copies of that header, on the committing thread, in the same call
//!   that wrote the frames. The commit's frames are written as soon as its
//!   commit frame is whole (so a failed write fails the commit), and the
//!   barrier writes whatever the calling thread still holds, so no reader
//!   can be told of a frame the kernel does not have.
//!
//! Durability is unchanged: a `synchronous = FULL` commit syncs the WAL,
//! and the sync flushes first; a NORMAL commit is in the kernel, as
//! before, once it is visible. Only frames of a commit not yet published
//! wait in memory, and a crash loses those either way.
//!
//! Everything else, the database file and all locking, is SQLite's unix
//! VFS unchanged: each call is forwarded to it.

use std::cell::RefCell;
use std::ffi::{CStr, c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use rusqlite::ffi;

use super::Locking;

/// The names connections open the database with: over SQLite's default
/// unix VFS, and over its `unix-excl` variant for `locking=exclusive`.
const NAME: &CStr = c"arbor-unix";
const EXCLUSIVE_NAME: &CStr = c"arbor-unix-excl";

/// A WAL frame header's size (the WAL format's, fixed).
const FRAME_HEADER: usize = 24;

/// Appends held at most before they are written anyway: the most the unix
/// VFS writes in one call (it masks a write's length with 0x1ffff, so a
/// longer one came out short and the commit failed as "disk full"). A
/// larger group commit goes out in writes of this size as it is appended
/// (~30 frames each, one call where there were 60), so the writer holds at
/// most this much, however large the group.
const BUFFER_LIMIT: usize = 0x1ffff & !0xfff;

/// Registers this layer over the unix VFS that does `locking` once; returns
/// its name, or `None` when SQLite has no such VFS to wrap (connections
/// then use the default, or fail for `Exclusive`: see `open_connection`).
///
/// `unix-excl` is SQLite's own unix VFS with one difference: the first
/// lock a process takes on the database file is an exclusive `fcntl` lock,
/// held until the last connection closes, after which the connections of
/// this process lock each other in memory only, and the WAL index lives in
/// heap memory instead of a shared `-shm` file. So a transaction makes no
/// lock system call (~5 a commit otherwise, and 2 a read), and no other
/// process can open the database meanwhile.
pub(super) fn register(locking: Locking) -> Option<&'static CStr> {
    static SHARED: OnceLock<bool> = OnceLock::new();
    static EXCLUSIVE: OnceLock<bool> = OnceLock::new();
    let (once, base_name, name) = match locking {
        Locking::Shared => (&SHARED, None, NAME),
        Locking::Exclusive => (&EXCLUSIVE, Some(c"unix-excl"), EXCLUSIVE_NAME),
    };
    let registered = *once.get_or_init(|| {
        // SAFETY: sqlite3_vfs_find returns a VFS SQLite keeps for the life
        // of the process (NULL: the default). The copy is leaked so that
        // SQLite may keep a pointer to it for ever.
        unsafe {
            let base = ffi::sqlite3_vfs_find(base_name.map_or(std::ptr::null(), CStr::as_ptr));
            if base.is_null() {
                return false;
            }
            let mut vfs = *base;
            vfs.szOsFile = (size_of::<BatchedFile>() as c_int + 7) / 8 * 8 + (*base).szOsFile;
            vfs.pNext = std::ptr::null_mut();
            vfs.zName = name.as_ptr();
            vfs.pAppData = base.cast();
            vfs.xOpen = Some(open);
            let vfs = Box::leak(Box::new(vfs));
            ffi::sqlite3_vfs_register(vfs, 0) == ffi::SQLITE_OK
        }
    });
    registered.then_some(name)
}

/// What SQLite allocates for each open file: this, then the unix VFS's own
/// file right after it.
#[repr(C)]
struct BatchedFile {
    base: ffi::sqlite3_file,
    real: *mut ffi::sqlite3_file,
    /// For a WAL file, its appends not yet written.
    wal: Option<Arc<Mutex<Pending>>>,
}

/// A WAL file's buffered appends.
struct Pending {
    /// The file they belong to (null once it is closed).
    real: *mut ffi::sqlite3_file,
    /// Where `bytes` start in the file.
    offset: i64,
    bytes: Vec<u8>,
    /// Whether this buffer is on its thread's list of buffers to flush.
    listed: bool,
    /// Where the page of a commit frame whose header was just appended
    /// goes: once it is appended too, the commit's frames are written.
    commit_page_at: Option<i64>,
}

// SAFETY: `real` is only used under the mutex, and SQLite allows a file to
// be used from any thread as long as calls do not overlap.
unsafe impl Send for Pending {}

impl Pending {
    /// Writes the buffered bytes; SQLite's result code.
    fn flush(&mut self) -> c_int {
        if self.bytes.is_empty() || self.real.is_null() {
            self.bytes.clear();
            return ffi::SQLITE_OK;
        }
        #[cfg(test)]
        tests::WAL_WRITES.with(|count| count.set(count.get() + 1));
        // SAFETY: `real` is an open unix file (cleared when it closes);
        // `bytes` holds at most BUFFER_LIMIT bytes (see `write`).
        let rc = unsafe {
            (*self.real).pMethods.as_ref().and_then(|methods| methods.xWrite).map_or(ffi::SQLITE_IOERR_WRITE, |write| {
                write(self.real, self.bytes.as_ptr().cast(), self.bytes.len() as c_int, self.offset)
            })
        };
        self.bytes.clear();
        rc
    }
}

thread_local! {
    /// WAL buffers this thread appended to since it last flushed them.
    static UNFLUSHED: RefCell<Vec<Arc<Mutex<Pending>>>> = const { RefCell::new(Vec::new()) };
}

/// Writes every WAL buffer this thread holds; the first error, if any.
fn flush_thread() -> c_int {
    UNFLUSHED.with(|list| {
        let mut rc = ffi::SQLITE_OK;
        for pending in list.borrow_mut().drain(..) {
            let mut pending = pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            pending.listed = false;
            let flushed = pending.flush();
            if rc == ffi::SQLITE_OK {
                rc = flushed;
            }
        }
        rc
    })
}

/// Flushes `file`'s own buffer, when it is a WAL file.
unsafe fn flush_own(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite passes a file this VFS opened.
    match unsafe { &(*file.cast::<BatchedFile>()).wal } {
        Some(pending) => pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).flush(),
        None => ffi::SQLITE_OK,
    }
}

/// Calls `call` with the unix VFS's file under `file` and its methods.
unsafe fn forward(
    file: *mut ffi::sqlite3_file,
    call: impl FnOnce(*mut ffi::sqlite3_file, &ffi::sqlite3_io_methods) -> c_int,
) -> c_int {
    // SAFETY: SQLite passes a file this VFS opened, and an open unix file
    // has its methods set.
    unsafe {
        let real = (*file.cast::<BatchedFile>()).real;
        call(real, &*(*real).pMethods)
    }
}

/// Like [`forward`], after writing what `file` holds, for the calls that
/// read, size, sync or change a WAL file and must see every write before.
unsafe fn forward_flushed(
    file: *mut ffi::sqlite3_file,
    call: impl FnOnce(*mut ffi::sqlite3_file, &ffi::sqlite3_io_methods) -> c_int,
) -> c_int {
    // SAFETY: as in `forward`.
    unsafe {
        match flush_own(file) {
            ffi::SQLITE_OK => forward(file, call),
            failed => failed,
        }
    }
}

unsafe extern "C" fn open(
    vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    // SAFETY: SQLite gives `file` szOsFile bytes, aligned for a pointer:
    // room for a BatchedFile, padded to 8, then the unix VFS's file.
    unsafe {
        let base = (*vfs).pAppData.cast::<ffi::sqlite3_vfs>();
        let real = file.cast::<u8>().add(size_of::<BatchedFile>().div_ceil(8) * 8).cast::<ffi::sqlite3_file>();
        (*real).pMethods = std::ptr::null();
        std::ptr::write(
            file.cast::<BatchedFile>(),
            BatchedFile { base: ffi::sqlite3_file { pMethods: std::ptr::null() }, real, wal: None },
        );
        let Some(open_real) = (*base).xOpen else { return ffi::SQLITE_CANTOPEN };
        let rc = open_real(base, name, real, flags, out_flags);
        if (*real).pMethods.is_null() {
            // SQLite will not close a file without methods.
            std::ptr::drop_in_place(file.cast::<BatchedFile>());
            return rc;
        }
        if flags & ffi::SQLITE_OPEN_WAL != 0 {
            (*file.cast::<BatchedFile>()).wal = Some(Arc::new(Mutex::new(Pending {
                real,
                offset: 0,
                bytes: Vec::new(),
                listed: false,
                commit_page_at: None,
            })));
        }
        (*file).pMethods = &METHODS;
        rc
    }
}

static METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 3,
    xClose: Some(close),
    xRead: Some(read),
    xWrite: Some(write),
    xTruncate: Some(truncate),
    xSync: Some(sync),
    xFileSize: Some(file_size),
    xLock: Some(lock),
    xUnlock: Some(unlock),
    xCheckReservedLock: Some(check_reserved_lock),
    xFileControl: Some(file_control),
    xSectorSize: Some(sector_size),
    xDeviceCharacteristics: Some(device_characteristics),
    xShmMap: Some(shm_map),
    xShmLock: Some(shm_lock),
    xShmBarrier: Some(shm_barrier),
    xShmUnmap: Some(shm_unmap),
    xFetch: Some(fetch),
    xUnfetch: Some(unfetch),
};

unsafe extern "C" fn close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite closes each file it opened once, and uses it no more.
    unsafe {
        let flushed = flush_own(file);
        let this = file.cast::<BatchedFile>();
        if let Some(pending) = &(*this).wal {
            pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).real = std::ptr::null_mut();
        }
        let rc = forward(file, |real, methods| methods.xClose.map_or(ffi::SQLITE_OK, |close| close(real)));
        std::ptr::drop_in_place(this);
        if flushed != ffi::SQLITE_OK { flushed } else { rc }
    }
}

unsafe extern "C" fn read(file: *mut ffi::sqlite3_file, buffer: *mut c_void, amount: c_int, offset: i64) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward_flushed(file, |real, methods| {
            methods.xRead.map_or(ffi::SQLITE_IOERR_READ, |read| read(real, buffer, amount, offset))
        })
    }
}

unsafe extern "C" fn write(file: *mut ffi::sqlite3_file, buffer: *const c_void, amount: c_int, offset: i64) -> c_int {
    // SAFETY: forwarded as SQLite called it; `buffer` holds `amount` bytes.
    unsafe {
        let write_through = || {
            forward(file, |real, methods| {
                methods.xWrite.map_or(ffi::SQLITE_IOERR_WRITE, |write| write(real, buffer, amount, offset))
            })
        };
        let Some(wal) = &(*file.cast::<BatchedFile>()).wal else {
            return write_through();
        };
        let mut pending = wal.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let appends = !pending.bytes.is_empty() && offset == pending.offset + pending.bytes.len() as i64;
        if !appends || pending.bytes.len() + amount as usize > BUFFER_LIMIT {
            let flushed = pending.flush();
            if flushed != ffi::SQLITE_OK {
                return flushed;
            }
            if amount as usize > BUFFER_LIMIT {
                // Larger than any frame (SQLite writes none such): passed
                // on as it came, as without this layer.
                return write_through();
            }
            pending.offset = offset;
        }
        let bytes = std::slice::from_raw_parts(buffer.cast::<u8>(), amount.max(0) as usize);
        pending.bytes.extend_from_slice(bytes);
        if pending.commit_page_at == Some(offset) {
            // The commit frame's page: the commit is whole, write it now, so
            // that a failure is the commit's and SQLite does not publish it.
            pending.commit_page_at = None;
            return pending.flush();
        }
        // A frame header's second word is the database's size after the
        // commit for a commit frame, and zero for any other.
        pending.commit_page_at =
            (bytes.len() == FRAME_HEADER && bytes[4..8] != [0; 4]).then_some(offset + FRAME_HEADER as i64);
        if !pending.listed {
            pending.listed = true;
            UNFLUSHED.with(|list| list.borrow_mut().push(Arc::clone(wal)));
        }
        ffi::SQLITE_OK
    }
}

unsafe extern "C" fn truncate(file: *mut ffi::sqlite3_file, size: i64) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward_flushed(file, |real, methods| {
            methods.xTruncate.map_or(ffi::SQLITE_IOERR_TRUNCATE, |truncate| truncate(real, size))
        })
    }
}

unsafe extern "C" fn sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward_flushed(file, |real, methods| methods.xSync.map_or(ffi::SQLITE_IOERR_FSYNC, |sync| sync(real, flags)))
    }
}

unsafe extern "C" fn file_size(file: *mut ffi::sqlite3_file, size: *mut i64) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward_flushed(file, |real, methods| {
            methods.xFileSize.map_or(ffi::SQLITE_IOERR_FSTAT, |file_size| file_size(real, size))
        })
    }
}

unsafe extern "C" fn lock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe { forward(file, |real, methods| methods.xLock.map_or(ffi::SQLITE_IOERR_LOCK, |lock| lock(real, level))) }
}

unsafe extern "C" fn unlock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward(file, |real, methods| methods.xUnlock.map_or(ffi::SQLITE_IOERR_UNLOCK, |unlock| unlock(real, level)))
    }
}

unsafe extern "C" fn check_reserved_lock(file: *mut ffi::sqlite3_file, out: *mut c_int) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward(file, |real, methods| {
            methods.xCheckReservedLock.map_or(ffi::SQLITE_IOERR_CHECKRESERVEDLOCK, |check| check(real, out))
        })
    }
}

unsafe extern "C" fn file_control(file: *mut ffi::sqlite3_file, op: c_int, argument: *mut c_void) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward_flushed(file, |real, methods| {
            methods.xFileControl.map_or(ffi::SQLITE_NOTFOUND, |control| control(real, op, argument))
        })
    }
}

unsafe extern "C" fn sector_size(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe { forward(file, |real, methods| methods.xSectorSize.map_or(4096, |sector_size| sector_size(real))) }
}

unsafe extern "C" fn device_characteristics(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward(file, |real, methods| methods.xDeviceCharacteristics.map_or(0, |characteristics| characteristics(real)))
    }
}

// The unix VFS's methods are version 3 (shared memory and mmap); were they
// older, these answer as SQLite does for a file without them.

unsafe extern "C" fn shm_map(
    file: *mut ffi::sqlite3_file,
    region: c_int,
    size: c_int,
    extend: c_int,
    out: *mut *mut c_void,
) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward(file, |real, methods| match methods.xShmMap.filter(|_| methods.iVersion >= 2) {
            Some(map) => map(real, region, size, extend, out),
            None => ffi::SQLITE_IOERR_SHMMAP,
        })
    }
}

unsafe extern "C" fn shm_lock(file: *mut ffi::sqlite3_file, offset: c_int, count: c_int, flags: c_int) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward(file, |real, methods| match methods.xShmLock.filter(|_| methods.iVersion >= 2) {
            Some(lock) => lock(real, offset, count, flags),
            None => ffi::SQLITE_IOERR_SHMLOCK,
        })
    }
}

unsafe extern "C" fn shm_barrier(file: *mut ffi::sqlite3_file) {
    // A commit's frames are written with its commit frame (see `write`),
    // so there is nothing left here but in a rare case: SQLite rewriting
    // the checksums of frames of the same transaction. A barrier cannot
    // fail, and SQLite is about to tell readers the frames are there; if
    // the kernel refused them, going on could hand readers pages that were
    // never written, so the process stops instead (as PostgreSQL does when
    // an fsync fails).
    let flushed = flush_thread();
    if flushed != ffi::SQLITE_OK {
        eprintln!("arbor: writing SQLite's write-ahead log failed (SQLite error {flushed}); stopping");
        std::process::abort();
    }
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward(file, |real, methods| {
            if let Some(barrier) = methods.xShmBarrier.filter(|_| methods.iVersion >= 2) {
                barrier(real);
            }
            ffi::SQLITE_OK
        });
    }
}

unsafe extern "C" fn shm_unmap(file: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward(file, |real, methods| match methods.xShmUnmap.filter(|_| methods.iVersion >= 2) {
            Some(unmap) => unmap(real, delete),
            None => ffi::SQLITE_OK,
        })
    }
}

unsafe extern "C" fn fetch(file: *mut ffi::sqlite3_file, offset: i64, amount: c_int, out: *mut *mut c_void) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward_flushed(file, |real, methods| match methods.xFetch.filter(|_| methods.iVersion >= 3) {
            Some(fetch) => fetch(real, offset, amount, out),
            None => {
                *out = std::ptr::null_mut();
                ffi::SQLITE_OK
            }
        })
    }
}

unsafe extern "C" fn unfetch(file: *mut ffi::sqlite3_file, offset: i64, pointer: *mut c_void) -> c_int {
    // SAFETY: forwarded as SQLite called it.
    unsafe {
        forward(file, |real, methods| match methods.xUnfetch.filter(|_| methods.iVersion >= 3) {
            Some(unfetch) => unfetch(real, offset, pointer),
            None => ffi::SQLITE_OK,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::path::Path;

    use rusqlite::{Connection, OpenFlags, params};

    thread_local! {
        /// Writes this thread made to WAL files (counted in `Pending::flush`).
        pub(super) static WAL_WRITES: Cell<usize> = const { Cell::new(0) };
    }

    fn wal_writes() -> usize {
        WAL_WRITES.with(Cell::get)
    }

    /// A connection that does not go through this VFS, so reads what the
    /// files hold.
    fn plain(path: &Path) -> Connection {
        Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY).expect("opens")
    }

    fn rows(connection: &Connection) -> Vec<(i64, Vec<u8>)> {
        let mut statement = connection.prepare("SELECT id, body FROM t ORDER BY id").expect("prepares");
        statement
            .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))
            .expect("reads")
            .map(|row| row.expect("row"))
            .collect()
    }

    fn body(id: i64, length: usize) -> Vec<u8> {
        (0..length).map(|at| (at as i64 * 31 + id) as u8).collect()
    }

    #[test]
    fn a_commit_is_written_in_one_call_and_read_by_a_connection_without_the_vfs() {
        let folder = tempfile::tempdir().expect("temp dir");
        let path = folder.path().join("batched.db");
        let connection = super::super::open_connection(&path, super::Locking::Shared).expect("opens");
        connection.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB NOT NULL)", []).expect("creates");
        let reader = plain(&path);
        assert!(rows(&reader).is_empty());

        // Ten rows of 3,000 bytes: ten or more pages, each one frame of a
        // header and a page, so SQLite's own VFS would make twenty writes
        // or more. Committed with synchronous = NORMAL: no sync flushes it.
        let before = wal_writes();
        let transaction = connection.unchecked_transaction().expect("begins");
        for id in 0..10 {
            transaction.execute("INSERT INTO t VALUES (?, ?)", params![id, body(id, 3000)]).expect("inserts");
        }
        transaction.commit().expect("commits");
        assert_eq!(wal_writes() - before, 1, "one write for the whole commit");

        // The commit is in the files as soon as it is visible: another
        // connection with its own file handles reads it, and so does a copy
        // of the files (what is left if Arbor dies now).
        let expected: Vec<_> = (0..10).map(|id| (id, body(id, 3000))).collect();
        assert_eq!(rows(&reader), expected);
        let copy = folder.path().join("copy.db");
        std::fs::copy(&path, &copy).expect("copies the database");
        std::fs::copy(folder.path().join("batched.db-wal"), folder.path().join("copy.db-wal")).expect("copies the WAL");
        assert_eq!(rows(&plain(&copy)), expected);
    }

    #[test]
    fn a_commit_larger_than_one_write_of_the_unix_vfs_is_written_whole() {
        // SQLite's unix VFS writes at most 128 KiB - 1 bytes in one call;
        // a longer buffer must be cut, or the commit fails as "disk full".
        let folder = tempfile::tempdir().expect("temp dir");
        let path = folder.path().join("large.db");
        let connection = super::super::open_connection(&path, super::Locking::Shared).expect("opens");
        connection.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB NOT NULL)", []).expect("creates");
        let mut expected = Vec::new();
        for (round, rows_in_commit) in [40_i64, 64, 200].into_iter().enumerate() {
            let transaction = connection.unchecked_transaction().expect("begins");
            for at in 0..rows_in_commit {
                let id = round as i64 * 1000 + at;
                transaction.execute("INSERT INTO t VALUES (?, ?)", params![id, body(id, 3500)]).expect("inserts");
                expected.push((id, body(id, 3500)));
            }
            transaction.commit().expect("a commit of hundreds of KiB commits");
        }
        assert_eq!(rows(&plain(&path)), expected);
        drop(connection);
        // And the WAL is whole: reopened, every row is there.
        assert_eq!(rows(&super::super::open_connection(&path, super::Locking::Shared).expect("reopens")), expected);
    }
}
