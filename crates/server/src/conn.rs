//! The HTTP/1.1 listener, with the limits `axum::serve` does not offer: a cap on
//! open connections and a deadline for each phase of a connection in which the
//! peer, not the server, decides the pace.
//!
//! - **Connection cap** (`max_connections`): past it a new connection gets a 503
//!   and is closed, instead of waiting unseen in the accept backlog.
//! - **Idle** (`idle`): a kept-alive connection that sends no byte of its next
//!   request within this time of the last response is closed.
//! - **Headers** (`header`): a request's head must be complete within this time
//!   of its first byte (slowloris). hyper's own header timeout runs from the end
//!   of the previous response, i.e. it would also be the idle limit, so it is
//!   off and both deadlines are kept here.
//! - **Send** (`send`): a response that cannot be written for this long (the
//!   client stopped reading) ends the connection, which drops the response and
//!   so stops its generation instead of leaving the engine blocked on it.
//!
//! The body deadline belongs to the body reader (`http::read_body`), which can
//! answer it with a 408 in the dialect's shape. The phases come from the
//! requests themselves: a request is in flight from the moment hyper hands it to
//! the router until its response body is finished or dropped; between requests
//! the connection is idle until a byte arrives, then reading a head.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{sleep, Instant, Sleep};
use tower::ServiceExt;

/// Connection limits (`ds4 serve --max-connections`, `--idle-timeout`,
/// `--header-timeout`, `--send-timeout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: usize,
    pub idle: Duration,
    pub header: Duration,
    pub send: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 256,
            idle: Duration::from_secs(30),
            header: Duration::from_secs(10),
            send: Duration::from_secs(60),
        }
    }
}

/// What the listener reports (the binary prints it).
#[derive(Debug)]
pub enum ConnEvent {
    /// A connection was refused: the cap was reached.
    Refused { open: usize },
    /// `accept` failed (e.g. out of file descriptors); the listener waits and goes on.
    AcceptFailed(io::Error),
}

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting,
/// lets in-flight requests finish and closes idle connections.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    report: impl Fn(ConnEvent) + Send + Sync + 'static,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    report(ConnEvent::AcceptFailed(e));
                    sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            report(ConnEvent::Refused {
                open: limits.max_connections,
            });
            tokio::spawn(refuse(stream));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let phase = Arc::new(Phase::default());
        let io = TokioIo::new(Watched::new(stream, Arc::clone(&phase), limits));
        let app = app.clone();
        let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let in_flight = InFlight::start(Arc::clone(&phase));
            let app = app.clone();
            async move {
                let response = app.oneshot(req).await?;
                // The request stays in flight until hyper is done with the body.
                Ok::<_, Infallible>(response.map(|body| {
                    Body::new(body.map_frame(move |frame| {
                        let _ = &in_flight;
                        frame
                    }))
                }))
            }
        });
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(None)
            .serve_connection(io, service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            // A connection's errors (timeouts, resets, malformed requests) end
            // that connection only.
            let _ = conn.await;
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Answers a connection over the cap with a 503 and closes it.
async fn refuse(mut stream: TcpStream) {
    const BODY: &str = r#"{"error":{"message":"too many open connections (--max-connections); retry shortly","type":"overloaded_error"}}"#;
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{BODY}",
        BODY.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(reply.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

/// A connection's requests: how many have started and finished, so its reader
/// knows whether it is between requests.
#[derive(Default)]
struct Phase {
    started: AtomicU64,
    finished: AtomicU64,
    /// The connection's task, woken when a request finishes.
    waker: Mutex<Option<Waker>>,
}

impl Phase {
    /// Whether a request is in flight, and a stamp that changes whenever a
    /// request starts or finishes.
    fn now(&self) -> (bool, u64) {
        let finished = self.finished.load(Ordering::Acquire);
        let started = self.started.load(Ordering::Acquire);
        (started > finished, started + finished)
    }

    fn wake_at_end(&self, waker: &Waker) {
        let mut w = self.waker.lock().unwrap_or_else(|e| e.into_inner());
        if !w.as_ref().is_some_and(|w| w.will_wake(waker)) {
            *w = Some(waker.clone());
        }
    }
}

/// One request in flight; finished when dropped.
struct InFlight(Arc<Phase>);

impl InFlight {
    fn start(phase: Arc<Phase>) -> Self {
        phase.started.fetch_add(1, Ordering::AcqRel);
        InFlight(phase)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.finished.fetch_add(1, Ordering::AcqRel);
        let waker = self
            .0
            .waker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// The reading deadline in force, and what it was set for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// For the first byte of the next request.
    Idle,
    /// For the rest of a request head.
    Head,
}

/// A TCP stream that fails reads and writes whose phase ran past its deadline
/// (see the module doc); hyper then closes the connection.
struct Watched<Io> {
    io: Io,
    phase: Arc<Phase>,
    limits: Limits,
    /// The read deadline, the phase stamp it was set in, and what for.
    read: Option<(Pin<Box<Sleep>>, u64, Waiting)>,
    /// Since when writing has made no progress.
    write: Option<Pin<Box<Sleep>>>,
}

impl<Io> Watched<Io> {
    fn new(io: Io, phase: Arc<Phase>, limits: Limits) -> Self {
        Watched {
            io,
            phase,
            limits,
            read: None,
            write: None,
        }
    }

    fn timed_out(what: &str) -> io::Error {
        io::Error::new(io::ErrorKind::TimedOut, what.to_string())
    }
}

impl<Io: AsyncRead + Unpin> AsyncRead for Watched<Io> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        let (busy, stamp) = this.phase.now();
        if busy {
            // A body being read or a response being written: the body reader
            // and the send deadline look after those. hyper reads again only
            // when woken, so the request's end wakes it to start the idle
            // deadline.
            this.read = None;
            this.phase.wake_at_end(cx.waker());
            return polled;
        }
        // A new phase (a request started or finished since the deadline was
        // set) starts from idle.
        if this.read.as_ref().is_some_and(|(_, s, _)| *s != stamp) {
            this.read = None;
        }
        let got_bytes = matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before;
        let waiting = match (&this.read, got_bytes) {
            (Some((_, _, Waiting::Head)), _) | (_, true) => Waiting::Head,
            _ => Waiting::Idle,
        };
        if this.read.as_ref().is_none_or(|(_, _, w)| *w != waiting) {
            let limit = match waiting {
                Waiting::Idle => this.limits.idle,
                Waiting::Head => this.limits.header,
            };
            this.read = Some((Box::pin(sleep(limit)), stamp, waiting));
        }
        // Checked on every read, not only when it would wait: bytes that keep
        // trickling in must not keep a head alive past its deadline.
        if let Some((deadline, _, waiting)) = &mut this.read {
            let passed = deadline.deadline() <= Instant::now();
            if passed || (polled.is_pending() && deadline.as_mut().poll(cx).is_ready()) {
                return Poll::Ready(Err(Self::timed_out(match waiting {
                    Waiting::Idle => "idle connection",
                    Waiting::Head => "request headers too slow",
                })));
            }
        }
        polled
    }
}

impl<Io> Watched<Io> {
    /// Tracks a write's progress: a deadline while it is blocked, none once it moves.
    fn watch_write<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if !polled.is_pending() {
            self.write = None;
            return polled;
        }
        let limit = self.limits.send;
        let deadline = self.write.get_or_insert_with(|| Box::pin(sleep(limit)));
        if deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(Self::timed_out("the client stopped reading")));
        }
        Poll::Pending
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Watched<Io> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch_write(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch_write(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.watch_write(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn limits() -> Limits {
        Limits {
            max_connections: 1,
            idle: Duration::from_millis(300),
            header: Duration::from_millis(200),
            send: Duration::from_millis(250),
        }
    }

    #[test]
    fn phases_follow_requests() {
        let phase = Arc::new(Phase::default());
        let (busy, idle_stamp) = phase.now();
        assert!(!busy);
        let r = InFlight::start(Arc::clone(&phase));
        let (busy, stamp) = phase.now();
        assert!(busy && stamp != idle_stamp);
        drop(r);
        let (busy, after) = phase.now();
        assert!(!busy && after != stamp && after != idle_stamp);
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    /// Idle: closed after `idle` without a byte; a head begun is given
    /// `header` from its first byte, however it trickles; a request in flight
    /// has no read deadline here.
    #[test]
    fn read_deadlines_by_phase() {
        runtime().block_on(async {
            let (server, client) = tokio::io::duplex(64);
            let phase = Arc::new(Phase::default());
            let mut w = Watched::new(server, Arc::clone(&phase), limits());
            let mut buf = [0u8; 8];
            let t = tokio::time::Instant::now();
            let e = w.read(&mut buf).await.unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::TimedOut);
            assert!(
                t.elapsed() >= Duration::from_millis(300),
                "{:?}",
                t.elapsed()
            );

            let (server, mut client2) = tokio::io::duplex(64);
            let mut w = Watched::new(server, Arc::clone(&phase), limits());
            let t = tokio::time::Instant::now();
            let trickle = async {
                loop {
                    client2.write_all(b"G").await?;
                    assert_eq!(w.read(&mut buf).await?, 1);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            };
            let e: io::Result<()> = trickle.await;
            let e = e.unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::TimedOut);
            let took = t.elapsed();
            assert!(
                took >= Duration::from_millis(200) && took < Duration::from_millis(300),
                "{took:?}"
            );

            let (server, mut client3) = tokio::io::duplex(64);
            let mut w = Watched::new(server, Arc::clone(&phase), limits());
            let r = InFlight::start(Arc::clone(&phase));
            let read = tokio::time::timeout(Duration::from_millis(500), w.read(&mut buf)).await;
            assert!(read.is_err(), "no deadline while a request is in flight");
            drop(r);
            client3.write_all(b"x").await.unwrap();
            assert_eq!(w.read(&mut buf).await.unwrap(), 1);
            drop((client, client3));
        });
    }

    /// A response the peer does not read fails after `send`.
    #[test]
    fn a_stalled_write_fails_after_the_send_deadline() {
        runtime().block_on(async {
            let (server, _client) = tokio::io::duplex(16);
            let mut w = Watched::new(server, Arc::new(Phase::default()), limits());
            let t = tokio::time::Instant::now();
            let e = loop {
                if let Err(e) = w.write_all(&[0; 64]).await {
                    break e;
                }
            };
            assert_eq!(e.kind(), io::ErrorKind::TimedOut);
            assert!(
                t.elapsed() >= Duration::from_millis(250),
                "{:?}",
                t.elapsed()
            );
        });
    }
}
