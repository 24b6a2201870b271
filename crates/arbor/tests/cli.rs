//! The command line as scripts use it: `users add` and `keys create` print
//! the key alone on stdout, `serve` prints the first admin's key once and
//! stops cleanly on SIGTERM, and bad configs are refused with the problem
//! named.

mod common;

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

fn arbor() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_arbor"));
    command
        .env("RUST_LOG", "warn")
        .env_remove("OPENAI_API_KEY")
        .env_remove("ANTHROPIC_API_KEY")
        .env_remove("GEMINI_API_KEY");
    command
}

/// Whether an HTTP server answers at `listen`. A bare TCP connect is not
/// enough: to a free port in the ephemeral range, a connect now and then
/// lands on its own source port and "succeeds" (TCP simultaneous open), and
/// the SIGTERM then hit a server still starting.
fn answers_http(listen: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(listen) else { return false };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut answer = [0u8; 5];
    stream.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").is_ok()
        && stream.read_exact(&mut answer).is_ok()
        && &answer == b"HTTP/"
}

/// A loopback address no server listens on yet.
fn free_listen() -> String {
    format!("127.0.0.1:{}", common::free_port())
}

/// Waits (up to 10 s) until the server started at `listen` answers.
fn wait_until_serving(listen: &str) {
    let ready = (0..100).any(|_| {
        let answers = answers_http(listen);
        if !answers {
            std::thread::sleep(Duration::from_millis(100));
        }
        answers
    });
    assert!(ready, "serve listens on {listen}");
}

/// Stops a server with SIGTERM; what it printed, once it exited cleanly.
fn stop(server: Child) -> Output {
    let status = Command::new("kill").args(["-TERM", &server.id().to_string()]).status().expect("kill");
    assert!(status.success());
    let output = server.wait_with_output().expect("serve exits");
    assert!(output.status.success(), "a clean exit on SIGTERM: {:?}", output.status);
    output
}

fn stdout_of(command: &mut Command) -> String {
    let output = command.output().expect("arbor runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).expect("utf-8")
}

#[test]
fn users_and_keys_print_the_key_alone_and_keys_work_once_hashed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().to_str().expect("path");
    let first = stdout_of(arbor().args(["users", "add", "alice", "--data-dir", data]));
    let key = first.trim();
    assert_eq!(first.lines().count(), 1, "only the key: {first:?}");
    assert!(key.starts_with("arb_") && key.len() == 68, "{key}");
    let second = stdout_of(arbor().args(["keys", "create", "--user", "alice", "--data-dir", data]));
    assert_ne!(second.trim(), key, "every key is new");

    // The database holds neither key, only hashes.
    let database = std::fs::read(dir.path().join("arbor.db")).expect("database file");
    let text = String::from_utf8_lossy(&database);
    assert!(!text.contains(key) && !text.contains(second.trim()));

    let duplicate = arbor().args(["users", "add", "alice", "--data-dir", data]).output().expect("runs");
    assert!(!duplicate.status.success());
    assert!(String::from_utf8_lossy(&duplicate.stderr).contains("already exists"));
    let unknown = arbor().args(["keys", "create", "--user", "nobody", "--data-dir", data]).output().expect("runs");
    assert!(!unknown.status.success());
}

#[test]
fn a_config_with_an_unknown_key_is_refused_naming_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("arbor.toml");
    std::fs::write(&config, "[server]\nlisten = \"127.0.0.1:0\"\nlisen = 1\n").expect("written");
    let output = arbor()
        .args(["users", "add", "x", "--config"])
        .arg(&config)
        .args(["--data-dir", dir.path().to_str().expect("path")])
        .output()
        .expect("runs");
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("lisen"));
}

#[test]
fn serve_prints_the_first_admin_key_once_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().expect("temp dir");
    let listen = free_listen();
    let start = || {
        arbor()
            .args(["serve", "--listen", &listen, "--data-dir", dir.path().to_str().expect("path")])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("serve starts")
    };
    for run in 0..2 {
        let child = start();
        wait_until_serving(&listen);
        let output = stop(child);
        let stdout = String::from_utf8_lossy(&output.stdout);
        if run == 0 {
            assert!(stdout.contains("arb_") && stdout.contains("Authorization: Bearer"), "{stdout}");
        } else {
            assert!(!stdout.contains("arb_"), "the key is shown only once: {stdout}");
        }
    }
}

#[test]
fn under_exclusive_locking_other_processes_are_told_at_once_until_the_server_stops() {
    let dir = tempfile::tempdir().expect("temp dir");
    let listen = free_listen();
    let config = dir.path().join("arbor.toml");
    let database = dir.path().join("arbor.db");
    std::fs::write(
        &config,
        format!("[storage]\ndatabase_url = \"sqlite://{}?locking=exclusive\"\n", database.display()),
    )
    .expect("written");
    let add_bob = || arbor().args(["users", "add", "bob", "--config"]).arg(&config).output().expect("runs");
    let server = arbor()
        .args(["serve", "--listen", &listen, "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("serve starts");
    wait_until_serving(&listen);

    let started = std::time::Instant::now();
    let refused = add_bob();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("in use by another process") && stderr.contains("locking=exclusive"), "{stderr}");
    // Not after the 10 s a shared lock may be waited for.
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());

    stop(server);
    let added = add_bob();
    assert!(added.status.success(), "{}", String::from_utf8_lossy(&added.stderr));
    assert!(String::from_utf8_lossy(&added.stdout).starts_with("arb_"));
}
