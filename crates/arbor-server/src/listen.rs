//! The accept loop: each connection is served by hyper's HTTP/1.1 machinery
//! straight from the router.
//!
//! Why not `axum::serve`: for every connection it rebuilds the router's route
//! table (~5.6 KB, kept for the connection's life), and it reads through
//! hyper-util's protocol sniffing, whose first 24-byte read leaves hyper's read
//! buffer too short, so it grows from 8 to 16 KiB. A kept-alive connection
//! held both; at S2's 3,000 turns/s hundreds of them are open (ARCHITECTURE.md,
//! "Deliberate choices"). Arbor speaks HTTP/1.1 only, as it did behind axum.

use std::io;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long a connection may take to send a request's head, counted from
/// when the server starts waiting for it: a connection that stays silent
/// (or trickles a head in) this long after its last answer is closed, so
/// idle or stalled clients cannot hold connections (and file descriptors)
/// forever. A stream being answered is not waiting for a head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves `app` on `listener` until `stop` is cancelled; then stops
/// accepting, lets each connection finish the request it is in (an idle one
/// closes at once) and returns when all have closed.
pub async fn serve_http1(listener: TcpListener, app: Router, stop: CancellationToken) {
    serve_http1_with(listener, app, stop, HEAD_TIMEOUT).await;
}

async fn serve_http1_with(listener: TcpListener, app: Router, stop: CancellationToken, head_timeout: Duration) {
    // Every route becomes a ready service here, once, so that a connection
    // only clones an `Arc`.
    let app = app.with_state(());
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(head_timeout);
    let connections = TaskTracker::new();
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(error) => {
                    pause_after(error).await;
                    continue;
                }
            },
            () = stop.cancelled() => break,
        };
        connections.spawn(serve_connection(tcp, http.clone(), app.clone(), stop.clone()));
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

async fn serve_connection(tcp: TcpStream, http: http1::Builder, app: Router, stop: CancellationToken) {
    // Small SSE writes must leave at once: with Nagle's algorithm on, each
    // event after the first waits for the client's delayed ACK (~40 ms).
    let _ = tcp.set_nodelay(true);
    let connection = http.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(app));
    let mut connection = std::pin::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = stop.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(error) = result {
        tracing::debug!(%error, "connection ended with an error");
    }
}

/// A refused or reset connection is the client's business; anything else
/// (out of file descriptors, say) would fail again at once, so wait a
/// second before the next accept.
async fn pause_after(error: io::Error) {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(error.kind(), ConnectionAborted | ConnectionRefused | ConnectionReset) {
        return;
    }
    tracing::error!(%error, "could not accept a connection");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::Duration;

    use axum::Router;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::task::JoinHandle;
    use tokio_util::sync::CancellationToken;

    use super::{HEAD_TIMEOUT, serve_http1_with};

    /// The loop on a free port, serving `/quick` at once and `/slow` after
    /// `slow`.
    async fn start(slow: Duration, head_timeout: Duration) -> (SocketAddr, CancellationToken, JoinHandle<()>) {
        let app = Router::new().route("/quick", get(|| async { "quick!" })).route(
            "/slow",
            get(move || async move {
                tokio::time::sleep(slow).await;
                "slow!"
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bound");
        let address = listener.local_addr().expect("address");
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve_http1_with(listener, app, stop.clone(), head_timeout));
        (address, stop, server)
    }

    /// What the server sends until it closes the connection (at most 5 s).
    async fn rest_until_closed(mut tcp: TcpStream) -> String {
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut rest)).await;
        assert!(matches!(read, Ok(Ok(_))), "closed by the server: {read:?}");
        String::from_utf8_lossy(&rest).into_owned()
    }

    async fn get_on(tcp: &mut TcpStream, path: &str) -> String {
        let request = format!("GET {path} HTTP/1.1\r\nhost: arbor\r\n\r\n");
        tcp.write_all(request.as_bytes()).await.expect("request sent");
        let mut answer = Vec::new();
        let mut chunk = [0u8; 1024];
        // The test's bodies are short and end with "!".
        while !answer.ends_with(b"!") {
            let read = tcp.read(&mut chunk).await.expect("answer read");
            assert!(read > 0, "the connection closed mid-answer: {}", String::from_utf8_lossy(&answer));
            answer.extend_from_slice(&chunk[..read]);
        }
        String::from_utf8(answer).expect("utf-8")
    }

    #[tokio::test]
    async fn stopping_finishes_the_request_in_progress_and_does_not_wait_for_idle_connections() {
        let (address, stop, server) = start(Duration::from_millis(300), HEAD_TIMEOUT).await;

        // A kept-alive connection that has had its answer and sits idle.
        let mut idle = TcpStream::connect(address).await.expect("connected");
        let answer = get_on(&mut idle, "/quick").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

        let mut busy = TcpStream::connect(address).await.expect("connected");
        let slow = tokio::spawn(async move { get_on(&mut busy, "/slow").await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.cancel();

        let answer = slow.await.expect("slow request");
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("slow!"), "{answer}");
        assert!(answer.to_ascii_lowercase().contains("connection: close"), "told not to reuse it: {answer}");
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("the idle connection did not hold the server")
            .expect("the accept loop ended cleanly");
        let rest = rest_until_closed(idle).await;
        assert!(rest.is_empty(), "the idle connection was closed without more: {rest}");
        assert!(TcpStream::connect(address).await.is_err(), "no new connections once stopped");
    }

    #[tokio::test]
    async fn a_connection_that_sends_no_whole_head_in_time_is_closed() {
        let (address, stop, server) = start(Duration::from_millis(600), Duration::from_millis(300)).await;

        // Half a head, then nothing: closed without an answer to act on.
        let mut stalled = TcpStream::connect(address).await.expect("connected");
        stalled.write_all(b"GET /quick HTTP/1.1\r\nhost: ar").await.expect("sent");
        let started = std::time::Instant::now();
        let answer = rest_until_closed(stalled).await;
        assert!(started.elapsed() >= Duration::from_millis(250), "not before the timeout");
        assert!(!answer.contains("quick!"), "{answer}");

        // Answered, then silent: closed too, after its answer.
        let mut idle = TcpStream::connect(address).await.expect("connected");
        let answer = get_on(&mut idle, "/quick").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        rest_until_closed(idle).await;

        // One that keeps asking within the timeout is served every time,
        // and an answer that takes longer than the timeout is not cut.
        let mut busy = TcpStream::connect(address).await.expect("connected");
        let answer = get_on(&mut busy, "/slow").await;
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("slow!"), "{answer}");
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let answer = get_on(&mut busy, "/quick").await;
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        }
        stop.cancel();
        server.await.expect("the accept loop ended cleanly");
    }
}
