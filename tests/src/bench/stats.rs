//! Percentiles of one round and medians across rounds.

use serde_json::{Map, Value, json};

/// The `p`th percentile (nearest rank on the sorted values); NaN when empty.
pub fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// `{"n", "p50", "p99", "max", "mean"}` of `values` (milliseconds, rounded to µs).
pub fn summary(values: &[f64]) -> Value {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    let mean = if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    };
    json!({
        "n": v.len(),
        "p50": num(pct(&v, 50.0)),
        "p99": num(pct(&v, 99.0)),
        "max": num(v.last().copied().unwrap_or(f64::NAN)),
        "mean": num(mean),
    })
}

/// A JSON number rounded to 3 decimals, or null when not finite.
pub fn num(x: f64) -> Value {
    if x.is_finite() {
        json!((x * 1000.0).round() / 1000.0)
    } else {
        Value::Null
    }
}

/// The median of each figure across rounds: numbers by median, booleans by "all true", objects
/// key by key; anything else is taken from the first round.
pub fn median(rounds: &[Value]) -> Value {
    let Some(first) = rounds.first() else {
        return Value::Null;
    };
    match first {
        Value::Object(o) => {
            let mut out = Map::new();
            for k in o.keys() {
                let vals: Vec<Value> = rounds
                    .iter()
                    .map(|r| r.get(k).cloned().unwrap_or(Value::Null))
                    .collect();
                out.insert(k.clone(), median(&vals));
            }
            Value::Object(out)
        }
        Value::Number(_) => {
            let mut v: Vec<f64> = rounds.iter().filter_map(Value::as_f64).collect();
            if v.is_empty() {
                return Value::Null;
            }
            v.sort_by(|a, b| a.total_cmp(b));
            let m = if v.len() % 2 == 1 {
                v[v.len() / 2]
            } else {
                (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
            };
            num(m)
        }
        Value::Bool(_) => Value::Bool(rounds.iter().all(|r| r.as_bool() == Some(true))),
        Value::Null => {
            // A figure missing in the first round may exist in later ones.
            let rest: Vec<Value> = rounds.iter().filter(|r| !r.is_null()).cloned().collect();
            if rest.is_empty() {
                Value::Null
            } else {
                median(&rest)
            }
        }
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_rounds_goes_key_by_key() {
        let rounds = [
            json!({"a": 1.0, "b": {"c": 10}, "ok": true, "x": null}),
            json!({"a": 3.0, "b": {"c": 30}, "ok": true, "x": 2}),
            json!({"a": 2.0, "b": {"c": 20}, "ok": false, "x": 4}),
        ];
        assert_eq!(
            median(&rounds),
            json!({"a": 2.0, "b": {"c": 20.0}, "ok": false, "x": 3.0})
        );
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(pct(&v, 50.0), 51.0);
        assert_eq!(pct(&v, 99.0), 99.0);
        assert!(pct(&[], 50.0).is_nan());
    }
}
