//! Compact JSON writing, byte for byte what `serde_json::to_string` writes,
//! with a faster string escape.
//!
//! serde_json looks at a string one byte at a time to find what must be
//! escaped; a turn writes ~170 strings, ~2.8 KB (ids, timestamps, keys, the
//! answer's text, the provider request's history), across its events, its
//! rows, its response and the upstream request, and that loop was ~5.6% of
//! a JSON turn's instructions (`bench/profile.sh`). Here a string is
//! checked eight bytes at a time and, as almost always, copied whole.
//!
//! Everything else is serde_json's behaviour, kept exactly: the same number
//! formatting (itoa, zmij), `null` for a non-finite float, the same object
//! shapes for enum variants, map keys that may be strings, integers, bools,
//! chars or finite floats (quoted), and `serde_json::value::RawValue`
//! written as is. The tests compare the two on every shape serde has.

use std::fmt::{Display, Write as _};

use serde::Serialize;
use serde::ser::{self, Error as _, Impossible};

/// The error type is serde_json's, so callers switching to these functions
/// keep their error handling.
pub type Error = serde_json::Error;
type Result<T> = std::result::Result<T, Error>;

/// `value` as compact JSON, as `serde_json::to_string` writes it.
pub fn to_string<T: ?Sized + Serialize>(value: &T) -> Result<String> {
    let mut out = String::with_capacity(128);
    write(&mut out, value)?;
    Ok(out)
}

/// `value` as compact JSON bytes, as `serde_json::to_vec` writes them.
pub fn to_vec<T: ?Sized + Serialize>(value: &T) -> Result<Vec<u8>> {
    to_string(value).map(String::into_bytes)
}

/// Appends `value` as compact JSON to `out`. On an error `out` holds
/// whatever was written before it.
pub fn write<T: ?Sized + Serialize>(out: &mut String, value: &T) -> Result<()> {
    value.serialize(Writer(out))
}

/// JSON text that is already written, put into the output as it is,
/// without being parsed again: what `serde_json::value::RawValue` is,
/// without the parse that making one costs. The maker vouches that the
/// text is one JSON value. Every serializer that knows `RawValue` takes it
/// as one: this module's writer and serde_json's copy it, `serde_json::
/// to_value` parses it into a `Value`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verbatim<'a>(pub &'a str);

impl Serialize for Verbatim<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        let mut raw = serializer.serialize_struct(RAW_VALUE_TOKEN, 1)?;
        raw.serialize_field(RAW_VALUE_TOKEN, self.0)?;
        raw.end()
    }
}

/// The name serde_json gives the one-field struct a `RawValue` serializes
/// as; its field holds the JSON text to write unchanged.
const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";

/// The bytes of `word` (little-endian) that end a JSON string's plain run
/// (a quote, a backslash or a control character below 0x20), as the high
/// bit of each. The usual zero-byte test: `(x - n * 0x01..) & !x & 0x80..`
/// flags a byte below `n` (for `n` ≤ 0x80); a borrow can flag bytes above
/// a flagged one, never below, so the lowest flag is the first such byte.
/// Used to write strings here and to read them in the OpenAI stream
/// reader.
#[inline]
pub fn special_bytes(word: u64) -> u64 {
    const ONES: u64 = u64::MAX / 255;
    const HIGHS: u64 = ONES * 0x80;
    let below = |x: u64, n: u64| x.wrapping_sub(ONES * n) & !x & HIGHS;
    below(word ^ (ONES * u64::from(b'"')), 1) | below(word ^ (ONES * u64::from(b'\\')), 1) | below(word, 0x20)
}

/// Appends `text` as a JSON string, quoted and escaped as serde_json does.
fn push_string(out: &mut String, text: &str) {
    out.reserve(text.len() + 2);
    out.push('"');
    match first_escape(text.as_bytes()) {
        None => out.push_str(text),
        Some(first) => push_escaped(out, text, first),
    }
    out.push('"');
}

/// Where the first byte that must be escaped is, checking eight bytes at a
/// time; the last (or only) short piece is checked as one word too,
/// overlapping what was checked already, or, under eight bytes, read as
/// two overlapping halves or put byte by byte into a word of spaces
/// (most keys and many values are that short, and copying them into a
/// padded word called `memcpy`).
fn first_escape(bytes: &[u8]) -> Option<usize> {
    let word_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("eight bytes"));
    let lowest = |mask: u64| mask.trailing_zeros() as usize / 8;
    let len = bytes.len();
    if len < 8 {
        let word = if len >= 4 {
            // Lanes 4 to 7 hold bytes len - 4 to len - 1.
            let half_at = |at: usize| u64::from(u32::from_le_bytes(bytes[at..at + 4].try_into().expect("four bytes")));
            half_at(0) | half_at(len - 4) << 32
        } else {
            let spaces = u64::from_le_bytes([b' '; 8]);
            bytes
                .iter()
                .enumerate()
                .fold(spaces, |word, (at, &byte)| word & !(0xff << (8 * at)) | u64::from(byte) << (8 * at))
        };
        let mask = special_bytes(word);
        // A byte in both halves is flagged in both; the lowest flag is
        // the first such byte either way. Under four bytes, lanes 4 to 7
        // are spaces and never flagged.
        return (mask != 0).then(|| match lowest(mask) {
            lane if lane >= 4 => len + lane - 8,
            lane => lane,
        });
    }
    let mut at = 0;
    while at + 8 <= len {
        let mask = special_bytes(word_at(at));
        if mask != 0 {
            return Some(at + lowest(mask));
        }
        at += 8;
    }
    // The bytes before `at` are clean, so the lowest marked lane of the
    // overlapping last word is at or after `at`.
    let mask = if at < len { special_bytes(word_at(len - 8)) } else { 0 };
    (mask != 0).then(|| len - 8 + lowest(mask))
}

/// Appends `text` escaped, its first byte to escape at `first`. Rare (a
/// quote, a backslash, a newline), so kept out of the common path.
#[cold]
#[inline(never)]
fn push_escaped(out: &mut String, text: &str, first: usize) {
    let bytes = text.as_bytes();
    let mut run = 0; // start of the bytes not yet copied
    for (at, &byte) in bytes.iter().enumerate().skip(first) {
        if needs_escape(byte) {
            out.push_str(&text[run..at]);
            push_escape(out, byte);
            run = at + 1;
        }
    }
    out.push_str(&text[run..]);
}

fn needs_escape(byte: u8) -> bool {
    byte < 0x20 || byte == b'"' || byte == b'\\'
}

fn push_escape(out: &mut String, byte: u8) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    match byte {
        b'"' => out.push_str("\\\""),
        b'\\' => out.push_str("\\\\"),
        0x08 => out.push_str("\\b"),
        0x0c => out.push_str("\\f"),
        b'\n' => out.push_str("\\n"),
        b'\r' => out.push_str("\\r"),
        b'\t' => out.push_str("\\t"),
        _ => {
            out.push_str("\\u00");
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
    }
}

fn push_display_string<T: ?Sized + Display>(out: &mut String, value: &T) {
    let mut text = String::new();
    // Writing to a String cannot fail; a `Display` that fails by itself is
    // a bug in it, and what it wrote before failing is kept.
    let _ = write!(text, "{value}");
    push_string(out, &text);
}

/// A finite float as serde_json writes it (zmij's shortest form).
fn push_finite<F: zmij::Float>(out: &mut String, value: F) {
    out.push_str(zmij::Buffer::new().format_finite(value));
}

/// A float value: `null` when it is not finite, as serde_json writes it.
fn push_float<F: zmij::Float>(out: &mut String, value: F, finite: bool) {
    if finite {
        push_finite(out, value);
    } else {
        out.push_str("null");
    }
}

fn push_integer<I: itoa::Integer>(out: &mut String, value: I) {
    out.push_str(itoa::Buffer::new().format(value));
}

/// The ten integer methods of a `Serializer`, each `|$this, $value| $body`.
macro_rules! integers {
    ($this:ident, $value:ident => $body:expr) => {
        integers!(@each $this, $value => $body; serialize_i8: i8, serialize_i16: i16, serialize_i32: i32,
            serialize_i64: i64, serialize_i128: i128, serialize_u8: u8, serialize_u16: u16,
            serialize_u32: u32, serialize_u64: u64, serialize_u128: u128);
    };
    (@each $this:ident, $value:ident => $body:expr; $($method:ident: $type:ty),*) => {
        $(
            fn $method(self, $value: $type) -> Result<()> {
                let $this = self;
                $body
            }
        )*
    };
}

/// The types and methods of a `Serializer` for a place that takes only a
/// scalar (an object key, a `RawValue`'s text): bytes, nothing, and every
/// compound are refused with `$error()`.
macro_rules! refuse_compounds {
    ($error:ident) => {
        type Ok = ();
        type Error = Error;
        type SerializeSeq = Impossible<(), Error>;
        type SerializeTuple = Impossible<(), Error>;
        type SerializeTupleStruct = Impossible<(), Error>;
        type SerializeTupleVariant = Impossible<(), Error>;
        type SerializeMap = Impossible<(), Error>;
        type SerializeStruct = Impossible<(), Error>;
        type SerializeStructVariant = Impossible<(), Error>;

        fn serialize_bytes(self, _value: &[u8]) -> Result<()> {
            Err($error())
        }

        fn serialize_none(self) -> Result<()> {
            Err($error())
        }

        fn serialize_unit(self) -> Result<()> {
            Err($error())
        }

        fn serialize_unit_struct(self, _name: &'static str) -> Result<()> {
            Err($error())
        }

        fn serialize_newtype_variant<T: ?Sized + Serialize>(
            self,
            _name: &'static str,
            _index: u32,
            _variant: &'static str,
            _value: &T,
        ) -> Result<()> {
            Err($error())
        }

        fn serialize_seq(self, _len: Option<usize>) -> Result<Self::SerializeSeq> {
            Err($error())
        }

        fn serialize_tuple(self, _len: usize) -> Result<Self::SerializeTuple> {
            Err($error())
        }

        fn serialize_tuple_struct(self, _name: &'static str, _len: usize) -> Result<Self::SerializeTupleStruct> {
            Err($error())
        }

        fn serialize_tuple_variant(
            self,
            _name: &'static str,
            _index: u32,
            _variant: &'static str,
            _len: usize,
        ) -> Result<Self::SerializeTupleVariant> {
            Err($error())
        }

        fn serialize_map(self, _len: Option<usize>) -> Result<Self::SerializeMap> {
            Err($error())
        }

        fn serialize_struct(self, _name: &'static str, _len: usize) -> Result<Self::SerializeStruct> {
            Err($error())
        }

        fn serialize_struct_variant(
            self,
            _name: &'static str,
            _index: u32,
            _variant: &'static str,
            _len: usize,
        ) -> Result<Self::SerializeStructVariant> {
            Err($error())
        }
    };
}

struct Writer<'a>(&'a mut String);

impl<'a> Writer<'a> {
    /// `{"variant":` — the start of an enum variant that carries data.
    fn open_variant(&mut self, variant: &str) {
        self.0.push('{');
        push_string(self.0, variant);
        self.0.push(':');
    }

    /// Opens an array or object, inside `{"variant":` when it is an enum
    /// variant's.
    fn open(mut self, open: char, close: char, len: Option<usize>, variant: Option<&str>) -> Compound<'a> {
        if let Some(variant) = variant {
            self.open_variant(variant);
        }
        self.0.push(open);
        let state = if len == Some(0) {
            self.0.push(close);
            State::Empty
        } else {
            State::First
        };
        Compound { out: self.0, state, variant: variant.is_some() }
    }
}

impl<'a> ser::Serializer for Writer<'a> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Compound<'a>;
    type SerializeTuple = Compound<'a>;
    type SerializeTupleStruct = Compound<'a>;
    type SerializeTupleVariant = Compound<'a>;
    type SerializeMap = Compound<'a>;
    type SerializeStruct = Compound<'a>;
    type SerializeStructVariant = Compound<'a>;

    fn serialize_bool(self, value: bool) -> Result<()> {
        self.0.push_str(if value { "true" } else { "false" });
        Ok(())
    }

    integers!(this, value => {
        push_integer(this.0, value);
        Ok(())
    });

    fn serialize_f32(self, value: f32) -> Result<()> {
        push_float(self.0, value, value.is_finite());
        Ok(())
    }

    fn serialize_f64(self, value: f64) -> Result<()> {
        push_float(self.0, value, value.is_finite());
        Ok(())
    }

    fn serialize_char(self, value: char) -> Result<()> {
        push_string(self.0, value.encode_utf8(&mut [0; 4]));
        Ok(())
    }

    fn serialize_str(self, value: &str) -> Result<()> {
        push_string(self.0, value);
        Ok(())
    }

    fn serialize_bytes(self, value: &[u8]) -> Result<()> {
        self.0.push('[');
        for (index, byte) in value.iter().enumerate() {
            if index > 0 {
                self.0.push(',');
            }
            push_integer(self.0, *byte);
        }
        self.0.push(']');
        Ok(())
    }

    fn serialize_none(self) -> Result<()> {
        self.serialize_unit()
    }

    fn serialize_some<T: ?Sized + Serialize>(self, value: &T) -> Result<()> {
        value.serialize(self)
    }

    fn serialize_unit(self) -> Result<()> {
        self.0.push_str("null");
        Ok(())
    }

    fn serialize_unit_struct(self, _name: &'static str) -> Result<()> {
        self.serialize_unit()
    }

    fn serialize_unit_variant(self, _name: &'static str, _index: u32, variant: &'static str) -> Result<()> {
        self.serialize_str(variant)
    }

    fn serialize_newtype_struct<T: ?Sized + Serialize>(self, _name: &'static str, value: &T) -> Result<()> {
        value.serialize(self)
    }

    fn serialize_newtype_variant<T: ?Sized + Serialize>(
        mut self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<()> {
        self.open_variant(variant);
        value.serialize(Writer(&mut *self.0))?;
        self.0.push('}');
        Ok(())
    }

    fn serialize_seq(self, len: Option<usize>) -> Result<Compound<'a>> {
        Ok(self.open('[', ']', len, None))
    }

    fn serialize_tuple(self, len: usize) -> Result<Compound<'a>> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_struct(self, _name: &'static str, len: usize) -> Result<Compound<'a>> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Compound<'a>> {
        Ok(self.open('[', ']', Some(len), Some(variant)))
    }

    fn serialize_map(self, len: Option<usize>) -> Result<Compound<'a>> {
        Ok(self.open('{', '}', len, None))
    }

    fn serialize_struct(self, name: &'static str, len: usize) -> Result<Compound<'a>> {
        if name == RAW_VALUE_TOKEN {
            return Ok(Compound { out: self.0, state: State::Raw, variant: false });
        }
        self.serialize_map(Some(len))
    }

    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Compound<'a>> {
        Ok(self.open('{', '}', Some(len), Some(variant)))
    }

    fn collect_str<T: ?Sized + Display>(self, value: &T) -> Result<()> {
        push_display_string(self.0, value);
        Ok(())
    }
}

#[derive(PartialEq, Eq)]
enum State {
    /// Opened and already closed: the length said there is nothing in it.
    Empty,
    First,
    Rest,
    /// A `RawValue`: its one field's text is written as is.
    Raw,
}

/// An array or object being written; `variant` when it sits inside the
/// `{"variant":` of an enum variant, which its end closes too.
struct Compound<'a> {
    out: &'a mut String,
    state: State,
    variant: bool,
}

impl Compound<'_> {
    fn separate(&mut self) {
        if self.state != State::First {
            self.out.push(',');
        }
        self.state = State::Rest;
    }

    fn element<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<()> {
        self.separate();
        value.serialize(Writer(&mut *self.out))
    }

    /// Writes the end: `close` unless the length closed it at once (or it
    /// is a `RawValue`, which has no brackets of its own), then the
    /// variant's `}`.
    fn close(self, close: char) -> Result<()> {
        if self.state != State::Empty && self.state != State::Raw {
            self.out.push(close);
        }
        if self.variant {
            self.out.push('}');
        }
        Ok(())
    }

    fn field<T: ?Sized + Serialize>(&mut self, key: &'static str, value: &T) -> Result<()> {
        if self.state == State::Raw {
            return if key == RAW_VALUE_TOKEN { value.serialize(RawText(self.out)) } else { Err(not_raw_text()) };
        }
        self.separate();
        push_string(self.out, key);
        self.out.push(':');
        value.serialize(Writer(&mut *self.out))
    }
}

/// The four array shapes (a sequence, a tuple, a tuple struct, a tuple
/// variant's fields): elements separated by commas, closed by `]`.
macro_rules! arrays {
    ($($shape:ident::$element:ident),*) => {
        $(
            impl ser::$shape for Compound<'_> {
                type Ok = ();
                type Error = Error;

                fn $element<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<()> {
                    self.element(value)
                }

                fn end(self) -> Result<()> {
                    self.close(']')
                }
            }
        )*
    };
}

arrays!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

impl ser::SerializeMap for Compound<'_> {
    type Ok = ();
    type Error = Error;

    fn serialize_key<T: ?Sized + Serialize>(&mut self, key: &T) -> Result<()> {
        self.separate();
        key.serialize(KeyWriter(self.out))?;
        self.out.push(':');
        Ok(())
    }

    fn serialize_value<T: ?Sized + Serialize>(&mut self, value: &T) -> Result<()> {
        value.serialize(Writer(&mut *self.out))
    }

    fn end(self) -> Result<()> {
        self.close('}')
    }
}

/// A struct's and a struct variant's fields: an object (or, for a
/// `RawValue`, its text).
macro_rules! structs {
    ($($shape:ident),*) => {
        $(
            impl ser::$shape for Compound<'_> {
                type Ok = ();
                type Error = Error;

                fn serialize_field<T: ?Sized + Serialize>(&mut self, key: &'static str, value: &T) -> Result<()> {
                    self.field(key, value)
                }

                fn end(self) -> Result<()> {
                    self.close('}')
                }
            }
        )*
    };
}

structs!(SerializeStruct, SerializeStructVariant);

fn key_must_be_a_string() -> Error {
    Error::custom("key must be a string")
}

/// An object key: strings as they are; integers, bools and finite floats
/// quoted, as serde_json writes them; anything else an error.
struct KeyWriter<'a>(&'a mut String);

impl KeyWriter<'_> {
    fn quoted(self, write: impl FnOnce(&mut String)) -> Result<()> {
        self.0.push('"');
        write(self.0);
        self.0.push('"');
        Ok(())
    }

    fn float<F: zmij::Float>(self, value: F, finite: bool) -> Result<()> {
        if !finite {
            return Err(Error::custom("float key must be finite (got NaN or +/-inf)"));
        }
        self.quoted(|out| push_finite(out, value))
    }
}

impl ser::Serializer for KeyWriter<'_> {
    refuse_compounds!(key_must_be_a_string);

    fn serialize_bool(self, value: bool) -> Result<()> {
        self.quoted(|out| out.push_str(if value { "true" } else { "false" }))
    }

    integers!(this, value => this.quoted(|out| push_integer(out, value)));

    fn serialize_f32(self, value: f32) -> Result<()> {
        self.float(value, value.is_finite())
    }

    fn serialize_f64(self, value: f64) -> Result<()> {
        self.float(value, value.is_finite())
    }

    // Strings, chars and unit variants are keys as they are values.
    fn serialize_char(self, value: char) -> Result<()> {
        ser::Serializer::serialize_char(Writer(self.0), value)
    }

    fn serialize_str(self, value: &str) -> Result<()> {
        ser::Serializer::serialize_str(Writer(self.0), value)
    }

    fn serialize_some<T: ?Sized + Serialize>(self, value: &T) -> Result<()> {
        value.serialize(self)
    }

    fn serialize_unit_variant(self, name: &'static str, index: u32, variant: &'static str) -> Result<()> {
        ser::Serializer::serialize_unit_variant(Writer(self.0), name, index, variant)
    }

    fn serialize_newtype_struct<T: ?Sized + Serialize>(self, _name: &'static str, value: &T) -> Result<()> {
        value.serialize(self)
    }

    fn collect_str<T: ?Sized + Display>(self, value: &T) -> Result<()> {
        push_display_string(self.0, value);
        Ok(())
    }
}

/// A `RawValue`'s text, written unchanged; only a string is accepted.
struct RawText<'a>(&'a mut String);

fn not_raw_text() -> Error {
    Error::custom("expected a RawValue's text")
}

impl ser::Serializer for RawText<'_> {
    refuse_compounds!(not_raw_text);

    fn serialize_str(self, value: &str) -> Result<()> {
        self.0.push_str(value);
        Ok(())
    }

    fn serialize_bool(self, _value: bool) -> Result<()> {
        Err(not_raw_text())
    }

    integers!(_this, _value => Err(not_raw_text()));

    fn serialize_f32(self, _value: f32) -> Result<()> {
        Err(not_raw_text())
    }

    fn serialize_f64(self, _value: f64) -> Result<()> {
        Err(not_raw_text())
    }

    fn serialize_char(self, _value: char) -> Result<()> {
        Err(not_raw_text())
    }

    fn serialize_some<T: ?Sized + Serialize>(self, _value: &T) -> Result<()> {
        Err(not_raw_text())
    }

    fn serialize_unit_variant(self, _name: &'static str, _index: u32, _variant: &'static str) -> Result<()> {
        Err(not_raw_text())
    }

    fn serialize_newtype_struct<T: ?Sized + Serialize>(self, _name: &'static str, _value: &T) -> Result<()> {
        Err(not_raw_text())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;
    use serde::ser::{SerializeMap, Serializer};
    use serde_json::Value;
    use serde_json::value::RawValue;

    use super::*;

    #[test]
    fn verbatim_text_is_written_as_it_is_by_both_writers_and_read_as_json() {
        #[derive(Serialize)]
        struct Request<'a> {
            model: &'a str,
            messages: Verbatim<'a>,
        }
        let text = r#"[{"role":"user","content":"a \"b\"\n"},{"role":"assistant","content":null}]"#;
        let request = Request { model: "m", messages: Verbatim(text) };
        let expected = format!(r#"{{"model":"m","messages":{text}}}"#);
        assert_eq!(same(&request).as_deref(), Some(expected.as_str()));
        assert_eq!(serde_json::to_value(&request).unwrap(), serde_json::from_str::<Value>(&expected).unwrap());
    }

    /// Both writers agree: the same text, or both refuse.
    fn same<T: ?Sized + Serialize>(value: &T) -> Option<String> {
        let ours = to_string(value).ok();
        let theirs = serde_json::to_string(value).ok();
        assert_eq!(ours, theirs);
        ours
    }

    #[derive(Serialize)]
    struct Unit;

    #[derive(Serialize)]
    struct Newtype(u8);

    #[derive(Serialize)]
    struct Pair(i32, &'static str);

    #[derive(Serialize)]
    struct Empty {}

    #[derive(Serialize)]
    enum Shape {
        Plain,
        Wrapped(String),
        Tuple(i8, bool),
        EmptyTuple(),
        Struct { width: f64, label: Option<String> },
        EmptyStruct {},
    }

    #[derive(Serialize)]
    #[serde(tag = "type", rename_all = "snake_case")]
    enum Tagged {
        Text { text: String },
        Image { url: String, detail: Option<String> },
    }

    #[derive(Serialize)]
    #[serde(tag = "t", content = "c")]
    enum Adjacent {
        One(u32),
        Two { a: char },
    }

    #[derive(Serialize)]
    #[serde(untagged)]
    enum Untagged {
        Number(i64),
        Words(Vec<String>),
    }

    #[derive(Serialize)]
    struct Flattened {
        id: &'static str,
        #[serde(flatten)]
        rest: BTreeMap<String, Value>,
        #[serde(skip_serializing_if = "Option::is_none")]
        skipped: Option<u8>,
    }

    struct Bytes(&'static [u8]);

    impl Serialize for Bytes {
        fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
            serializer.serialize_bytes(self.0)
        }
    }

    /// A map whose length hint is zero but which writes an entry anyway.
    struct LyingMap;

    impl Serialize for LyingMap {
        fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
            let mut map = serializer.serialize_map(Some(0))?;
            map.serialize_entry("k", &1)?;
            map.end()
        }
    }

    struct Shown(&'static str);

    impl Serialize for Shown {
        fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
            serializer.collect_str(&format_args!("<{}>", self.0))
        }
    }

    #[test]
    fn every_serde_shape_is_written_as_serde_json_writes_it() {
        same(&Unit);
        same(&Newtype(7));
        same(&Pair(-3, "x"));
        same(&Empty {});
        same(&());
        same(&(1u8, "two", 3.5f32));
        same(&[0u8; 0]);
        same(&Vec::<String>::new());
        same(&BTreeMap::<String, u8>::new());
        for shape in [
            Shape::Plain,
            Shape::Wrapped("w".into()),
            Shape::Tuple(-1, true),
            Shape::EmptyTuple(),
            Shape::Struct { width: 1.5, label: None },
            Shape::Struct { width: f64::NAN, label: Some("l".into()) },
            Shape::EmptyStruct {},
        ] {
            same(&shape);
            same(&vec![shape]);
        }
        same(&[Tagged::Text { text: "hi\n".into() }, Tagged::Image { url: "u".into(), detail: None }]);
        same(&[Adjacent::One(1), Adjacent::Two { a: '"' }]);
        same(&[Untagged::Number(-9), Untagged::Words(vec!["a".into(), "\u{1}".into()])]);
        let rest = BTreeMap::from([("b".to_string(), Value::from(2)), ("a".to_string(), Value::Null)]);
        same(&Flattened { id: "i", rest, skipped: None });
        same(&Bytes(b"\x00\xffab"));
        same(&Bytes(b""));
        same(&LyingMap);
        same(&Shown("a\"b"));
        same(&(i128::MIN, u128::MAX, i64::MIN, u64::MAX, -0.0f64, 1e300f64, f32::MIN_POSITIVE));
        same(&(f32::INFINITY, f64::NEG_INFINITY, 'é', '\u{7f}', Some(Some(())), None::<u8>));
    }

    #[test]
    fn map_keys_are_quoted_or_refused_as_serde_json_does() {
        assert_eq!(same(&BTreeMap::from([(-1i64, "a"), (2, "b")])).as_deref(), Some(r#"{"-1":"a","2":"b"}"#));
        same(&BTreeMap::from([(u128::MAX, 0)]));
        same(&BTreeMap::from([(true, 1), (false, 0)]));
        same(&BTreeMap::from([('k', 1), ('"', 2)]));
        same(&BTreeMap::from([(Key("n".into()), 1)]));
        same(&BTreeMap::from([(Direction::Up, 1)]));
        same(&BTreeMap::from([(Some("s"), 1)]));
        let float_keys = [(1.5f64, 1)];
        same(&FloatKeys(&float_keys));
        assert_eq!(same(&FloatKeys(&[(f64::NAN, 1)])), None);
        assert_eq!(same(&BTreeMap::from([(vec![1], 1)])), None);
        assert_eq!(same(&BTreeMap::from([((), 1)])), None);
        assert_eq!(same(&BTreeMap::from([(None::<&str>, 1)])), None);
    }

    #[derive(Serialize, PartialEq, Eq, PartialOrd, Ord)]
    struct Key(String);

    #[derive(Serialize, PartialEq, Eq, PartialOrd, Ord)]
    enum Direction {
        Up,
    }

    struct FloatKeys<'a>(&'a [(f64, u8)]);

    impl Serialize for FloatKeys<'_> {
        fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
            let mut map = serializer.serialize_map(Some(self.0.len()))?;
            for (key, value) in self.0 {
                map.serialize_entry(key, value)?;
            }
            map.end()
        }
    }

    #[test]
    fn a_raw_value_is_written_unchanged() {
        let raw = RawValue::from_string(r#"{"already":"json" , "spaced": [1, 2]}"#.to_string()).expect("valid");
        let text = same(&BTreeMap::from([("raw", &raw)])).expect("writes");
        assert_eq!(text, r#"{"raw":{"already":"json" , "spaced": [1, 2]}}"#);
    }

    #[test]
    fn escapes_are_found_in_every_lane_of_a_word() {
        for special in ['"', '\\', '\n', '\u{0}', '\u{1f}', '\t', '\u{8}', '\u{c}', '\r'] {
            for before in 0..20 {
                for after in [0, 1, 7, 8, 9] {
                    let text = format!("{}{special}{}", "a".repeat(before), "é".repeat(after));
                    let written = same(&text).expect("writes");
                    assert_ne!(written, format!("\"{text}\""), "{text:?} must be escaped");
                }
            }
        }
        // Bytes next to the escaped ones that must not be: 0x20, 0x21,
        // 0x23, 0x5b, 0x5d, 0x7f and multi-byte characters.
        assert_eq!(same("\u{7f} !#[]ü€😀").as_deref(), Some("\"\u{7f} !#[]ü€😀\""));
        same("\u{1f}\u{20}\"\"\\\\\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}");
    }

    fn text() -> impl Strategy<Value = String> {
        let char = prop_oneof![
            4 => proptest::char::range('a', 'z'),
            1 => proptest::char::range('\u{0}', '\u{7f}'),
            1 => prop::sample::select(vec!['"', '\\', '\n', '\u{1f}', '\u{7f}', 'é', '€', '😀']),
            1 => any::<char>(),
        ];
        prop::collection::vec(char, 0..40).prop_map(|chars| chars.into_iter().collect())
    }

    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            text().prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..8).prop_map(Value::from),
                prop::collection::vec((text(), inner), 0..8)
                    .prop_map(|entries| Value::Object(entries.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// The lowest flag in a word is its first quote, backslash or
        /// control character, and no flag means there is none.
        #[test]
        fn a_words_first_special_byte_is_found(word in prop::array::uniform8(prop::sample::select(
            vec![0u8, 0x1f, 0x20, b'"', b'\\', b'!', b'#', b'[', b']', b'a', 0x7f, 0x80, 0xa0, 0xdc, 0xff],
        ))) {
            let first = word.iter().position(|&byte| byte < 0x20 || byte == b'"' || byte == b'\\');
            let flags = special_bytes(u64::from_le_bytes(word));
            let found = (flags != 0).then(|| (flags.trailing_zeros() / 8) as usize);
            prop_assert_eq!(found, first, "{:?}", word);
        }

        #[test]
        fn any_value_is_written_as_serde_json_writes_it(value in value()) {
            same(&value);
        }

        #[test]
        fn any_string_is_written_as_serde_json_writes_it(text in text(), wide in any::<String>()) {
            same(&text);
            same(&wide);
        }

        #[test]
        fn any_float_is_written_as_serde_json_writes_it(double in any::<f64>(), single in any::<f32>()) {
            same(&(double, single));
        }
    }
}
