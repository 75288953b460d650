//! `--record-filter` expressions, read as `record.py`'s `parse_filter` reads them (the worker
//! checked the expression before it started this writer: here an unreadable one is an error).

/// What a filter reads of an episode.
pub struct Summary {
    pub reward: f64,
    pub steps: f64,
    pub wall_s: f64,
    pub cpu_s: f64,
    pub bytes_in: f64,
    pub bytes_out: f64,
    pub error: bool,
    pub done: bool,
    pub truncated: bool,
    pub clipped: bool,
}

enum Term {
    Flag {
        name: String,
        negate: bool,
    },
    Compare {
        field: String,
        op: String,
        value: f64,
    },
}

/// Terms joined by `and` inside, `or` between.
pub struct Filter(Vec<Vec<Term>>);

fn split_word<'a>(text: &'a str, word: &str) -> Vec<&'a str> {
    // `\s+WORD\s+`: the word with whitespace on both sides
    let mut parts = Vec::new();
    let b = text.as_bytes();
    let w = word.as_bytes();
    let mut from = 0;
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_whitespace() {
            let mut j = i;
            while j < b.len() && b[j].is_ascii_whitespace() {
                j += 1;
            }
            if b[j..].starts_with(w) {
                let k = j + w.len();
                if k < b.len() && b[k].is_ascii_whitespace() {
                    let mut m = k;
                    while m < b.len() && b[m].is_ascii_whitespace() {
                        m += 1;
                    }
                    parts.push(&text[from..i]);
                    from = m;
                    i = m;
                    continue;
                }
            }
            i = j;
            continue;
        }
        i += 1;
    }
    parts.push(&text[from..]);
    parts
}

const FIELDS: [&str; 6] = [
    "reward",
    "steps",
    "wall_s",
    "cpu_s",
    "bytes_in",
    "bytes_out",
];
const FLAGS: [&str; 4] = ["error", "done", "truncated", "clipped"];
const OPS: [&str; 6] = [">=", "<=", "==", "!=", ">", "<"];

fn term(raw: &str) -> Result<Term, String> {
    let bad = || format!("--record-filter: cannot read {:?}", raw.trim());
    let mut s = raw.trim();
    let mut negate = false;
    if let Some(rest) = s.strip_prefix("not") {
        if rest.starts_with(|c: char| c.is_ascii_whitespace()) {
            negate = true;
            s = rest.trim_start();
        }
    }
    let name_len = s
        .bytes()
        .take_while(|c| c.is_ascii_lowercase() || *c == b'_')
        .count();
    if name_len == 0 {
        return Err(bad());
    }
    let name = &s[..name_len];
    let rest = s[name_len..].trim_start();
    if rest.is_empty() {
        if !FLAGS.contains(&name) {
            return Err(bad());
        }
        return Ok(Term::Flag {
            name: name.to_owned(),
            negate,
        });
    }
    let op = OPS
        .iter()
        .find(|op| rest.starts_with(*op))
        .ok_or_else(bad)?;
    let number = rest[op.len()..].trim();
    if negate || !FIELDS.contains(&name) {
        return Err(bad());
    }
    let ok = number == "inf"
        || (!number.is_empty()
            && number
                .bytes()
                .all(|c| c.is_ascii_digit() || matches!(c, b'.' | b'e' | b'E' | b'+' | b'-')));
    if !ok {
        return Err(bad());
    }
    let value = number.parse::<f64>().map_err(|_| bad())?;
    Ok(Term::Compare {
        field: name.to_owned(),
        op: (*op).to_owned(),
        value,
    })
}

impl Filter {
    /// `None` for an empty expression.
    pub fn parse(text: &str) -> Result<Option<Filter>, String> {
        if text.trim().is_empty() {
            return Ok(None);
        }
        let mut alternatives = Vec::new();
        for part in split_word(text.trim(), "or") {
            let mut terms = Vec::new();
            for raw in split_word(part, "and") {
                terms.push(term(raw)?);
            }
            alternatives.push(terms);
        }
        Ok(Some(Filter(alternatives)))
    }

    pub fn keep(&self, s: &Summary) -> bool {
        self.0.iter().any(|terms| terms.iter().all(|t| eval(t, s)))
    }
}

fn eval(t: &Term, s: &Summary) -> bool {
    match t {
        Term::Flag { name, negate } => {
            let v = match name.as_str() {
                "error" => s.error,
                "done" => s.done,
                "truncated" => s.truncated,
                _ => s.clipped,
            };
            v != *negate
        }
        Term::Compare { field, op, value } => {
            let x = match field.as_str() {
                "reward" => s.reward,
                "steps" => s.steps,
                "wall_s" => s.wall_s,
                "cpu_s" => s.cpu_s,
                "bytes_in" => s.bytes_in,
                _ => s.bytes_out,
            };
            match op.as_str() {
                ">=" => x >= *value,
                "<=" => x <= *value,
                "==" => x == *value,
                "!=" => x != *value,
                ">" => x > *value,
                _ => x < *value,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(reward: f64, steps: f64, error: bool, done: bool) -> Summary {
        Summary {
            reward,
            steps,
            wall_s: 0.0,
            cpu_s: 0.0,
            bytes_in: 0.0,
            bytes_out: 0.0,
            error,
            done,
            truncated: false,
            clipped: false,
        }
    }

    #[test]
    fn reads_expressions() {
        let f = Filter::parse("reward>0.9 or error and steps >= 5")
            .unwrap()
            .unwrap();
        assert!(f.keep(&s(1.0, 0.0, false, false)));
        assert!(!f.keep(&s(0.5, 4.0, true, false)));
        assert!(f.keep(&s(0.5, 5.0, true, false)));
        let f = Filter::parse("done and not error").unwrap().unwrap();
        assert!(f.keep(&s(0.0, 0.0, false, true)));
        assert!(!f.keep(&s(0.0, 0.0, true, true)));
        assert!(Filter::parse("").unwrap().is_none());
        assert!(Filter::parse("rewards>1").is_err());
        assert!(Filter::parse("not reward>1").is_err());
        assert!(Filter::parse("reward>x").is_err());
    }
}
