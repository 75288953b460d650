//! One shard's columns while its episodes gather (Arrow builders), and the shard written as
//! one Parquet file (zstd; dictionaries and statistics on the columns `rows.py` asks them for).

use std::fs::File;
use std::sync::Arc;

use arrow_array::builder::{
    BooleanBuilder, Float64Builder, Int64Builder, ListBuilder, StringBuilder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use crate::frames::Out;

/// The per-episode values of a row not in [`Out`].
pub struct Scalars<'a> {
    pub env: &'a str,
    pub env_version: &'a str,
    pub episode_id: Option<&'a str>,
    pub worker: i64,
    pub started_at: f64,
    pub seed: Option<i64>,
    pub options: Option<&'a str>,
    pub end: &'a str,
    pub clipped: bool,
    pub cost: &'a Cost,
}

/// An episode's cost (`EpisodeCost`).
#[derive(Default, Debug, Clone)]
pub struct Cost {
    pub wall_s: f64,
    pub cpu_s: f64,
    pub steps: i64,
    pub bytes_in: i64,
    pub bytes_out: i64,
    pub peak_rss_bytes: Option<i64>,
    pub cpu_source: String,
}

const SCALARS: [(&str, u8); 20] = [
    ("env", b's'),
    ("env_version", b's'),
    ("episode_id", b's'),
    ("worker", b'i'),
    ("started_at", b'f'),
    ("seed", b'i'),
    ("options", b's'),
    ("end", b's'),
    ("error", b's'),
    ("clipped", b'b'),
    ("total_reward", b'f'),
    ("steps", b'i'),
    ("wall_s", b'f'),
    ("cpu_s", b'f'),
    ("cpu_source", b's'),
    ("bytes_in", b'i'),
    ("bytes_out", b'i'),
    ("peak_rss_bytes", b'i'),
    ("reset_observation", b'j'),
    ("reset_info", b'j'),
];
const LISTS: [(&str, u8); 8] = [
    ("actions", b's'),
    ("observations", b's'),
    ("rewards", b'f'),
    ("dones", b'b'),
    ("truncateds", b'b'),
    ("infos", b's'),
    ("step_errors", b's'),
    ("step_s", b'f'),
];
/// Columns worth a dictionary (rows.py's `_DICTIONARY`).
const DICTIONARY: [&str; 6] = ["env", "env_version", "worker", "end", "error", "cpu_source"];

fn kind(k: u8) -> DataType {
    match k {
        b'i' => DataType::Int64,
        b'f' => DataType::Float64,
        b'b' => DataType::Boolean,
        _ => DataType::Utf8,
    }
}

fn item(k: u8) -> Arc<Field> {
    Arc::new(Field::new("item", kind(k), true))
}

/// The schema of a shard (rows.py's `schema`; every field nullable, as pyarrow's).
pub fn schema() -> SchemaRef {
    let mut fields: Vec<Field> = SCALARS
        .iter()
        .map(|(n, k)| Field::new(*n, kind(*k), true))
        .collect();
    for (n, k) in LISTS {
        fields.push(Field::new(n, DataType::List(item(k)), true));
    }
    Arc::new(Schema::new(fields))
}

pub struct Shard {
    pub rows: usize,
    s: Vec<StringBuilder>, // env, env_version, episode_id, options, end, error, cpu_source, reset_observation, reset_info
    i: Vec<Int64Builder>,  // worker, seed, steps, bytes_in, bytes_out, peak_rss_bytes
    f: Vec<Float64Builder>, // started_at, total_reward, wall_s, cpu_s
    clipped: BooleanBuilder,
    actions: ListBuilder<StringBuilder>,
    observations: ListBuilder<StringBuilder>,
    rewards: ListBuilder<Float64Builder>,
    dones: ListBuilder<BooleanBuilder>,
    truncateds: ListBuilder<BooleanBuilder>,
    infos: ListBuilder<StringBuilder>,
    step_errors: ListBuilder<StringBuilder>,
    step_s: ListBuilder<Float64Builder>,
}

/// A column's size carried over to the next shard, at most (items or bytes): a burst's big
/// shard does not leave its size allocated for the quiet ones after it.
const HINT_MAX: usize = 8 << 20;

/// The sizes of a shard's columns (its rows, their steps, each text column's bytes): the
/// next shard's builders are made this big at once, so that they do not grow by doubling
/// (each growth a copy, and fresh pages the kernel zeroes) as every shard's did.
#[derive(Default, Clone, Copy)]
struct Sizes {
    rows: usize,
    steps: usize,
    s: [usize; 9],
    lists: [usize; 4],
}

fn texts(steps: usize, bytes: usize) -> ListBuilder<StringBuilder> {
    ListBuilder::new(StringBuilder::with_capacity(steps, bytes)).with_field(item(b's'))
}

impl Shard {
    pub fn new() -> Self {
        Self::sized(Sizes::default())
    }

    fn sized(z: Sizes) -> Self {
        let (rows, steps) = (z.rows, z.steps);
        Shard {
            rows: 0,
            s: z.s
                .iter()
                .map(|&b| StringBuilder::with_capacity(rows, b))
                .collect(),
            i: (0..6).map(|_| Int64Builder::with_capacity(rows)).collect(),
            f: (0..4)
                .map(|_| Float64Builder::with_capacity(rows))
                .collect(),
            clipped: BooleanBuilder::with_capacity(rows),
            actions: texts(steps, z.lists[0]),
            observations: texts(steps, z.lists[1]),
            rewards: ListBuilder::new(Float64Builder::with_capacity(steps)).with_field(item(b'f')),
            dones: ListBuilder::new(BooleanBuilder::with_capacity(steps)).with_field(item(b'b')),
            truncateds: ListBuilder::new(BooleanBuilder::with_capacity(steps))
                .with_field(item(b'b')),
            infos: texts(steps, z.lists[2]),
            step_errors: texts(steps, z.lists[3]),
            step_s: ListBuilder::new(Float64Builder::with_capacity(steps)).with_field(item(b'f')),
        }
    }

    /// The sizes of the rows gathered, an eighth more (for the next shard's builders).
    fn sizes(&mut self) -> Sizes {
        let more = |n: usize| (n + n / 8).min(HINT_MAX);
        let mut z = Sizes {
            rows: more(self.rows),
            steps: more(self.rewards.values().values_slice().len()),
            ..Sizes::default()
        };
        for (k, b) in self.s.iter().enumerate() {
            z.s[k] = more(b.values_slice().len());
        }
        for (k, list) in [
            &mut self.actions,
            &mut self.observations,
            &mut self.infos,
            &mut self.step_errors,
        ]
        .into_iter()
        .enumerate()
        {
            z.lists[k] = more(list.values().values_slice().len());
        }
        z
    }

    pub fn add(&mut self, sc: &Scalars<'_>, out: &Out) {
        let c = sc.cost;
        let s = &mut self.s;
        s[0].append_value(sc.env);
        s[1].append_value(sc.env_version);
        s[2].append_option(sc.episode_id);
        s[3].append_option(sc.options);
        s[4].append_value(sc.end);
        s[5].append_option(out.error.as_deref());
        s[6].append_value(&c.cpu_source);
        s[7].append_option(out.text(out.reset_observation));
        s[8].append_option(out.text(out.reset_info));
        let i = &mut self.i;
        i[0].append_value(sc.worker);
        i[1].append_option(sc.seed);
        i[2].append_value(c.steps);
        i[3].append_value(c.bytes_in);
        i[4].append_value(c.bytes_out);
        i[5].append_option(c.peak_rss_bytes);
        let f = &mut self.f;
        f[0].append_value(sc.started_at);
        f[1].append_value(out.total);
        f[2].append_value(c.wall_s);
        f[3].append_value(c.cpu_s);
        self.clipped.append_value(sc.clipped);
        for (list, items) in [
            (&mut self.actions, &out.actions),
            (&mut self.observations, &out.observations),
            (&mut self.infos, &out.infos),
            (&mut self.step_errors, &out.errors),
        ] {
            let values = list.values();
            for t in items {
                values.append_option(out.text(*t));
            }
            list.append(true);
        }
        let rewards = self.rewards.values();
        for r in &out.rewards {
            rewards.append_option(*r);
        }
        self.rewards.append(true);
        self.dones.values().append_slice(&out.dones);
        self.dones.append(true);
        self.truncateds.values().append_slice(&out.truncateds);
        self.truncateds.append(true);
        self.step_s.values().append_slice(&out.step_s);
        self.step_s.append(true);
        self.rows += 1;
    }

    fn batch(&mut self) -> Result<RecordBatch, String> {
        let sizes = self.sizes();
        let mut s = self.s.iter_mut().map(|b| Arc::new(b.finish()) as ArrayRef);
        let mut i = self.i.iter_mut().map(|b| Arc::new(b.finish()) as ArrayRef);
        let mut f = self.f.iter_mut().map(|b| Arc::new(b.finish()) as ArrayRef);
        let (env, version, id, options, end, error, source, reset_obs, reset_info) = (
            s.next().unwrap(),
            s.next().unwrap(),
            s.next().unwrap(),
            s.next().unwrap(),
            s.next().unwrap(),
            s.next().unwrap(),
            s.next().unwrap(),
            s.next().unwrap(),
            s.next().unwrap(),
        );
        let (worker, seed, steps, bytes_in, bytes_out, rss) = (
            i.next().unwrap(),
            i.next().unwrap(),
            i.next().unwrap(),
            i.next().unwrap(),
            i.next().unwrap(),
            i.next().unwrap(),
        );
        let (started, total, wall, cpu) = (
            f.next().unwrap(),
            f.next().unwrap(),
            f.next().unwrap(),
            f.next().unwrap(),
        );
        let columns: Vec<ArrayRef> = vec![
            env,
            version,
            id,
            worker,
            started,
            seed,
            options,
            end,
            error,
            Arc::new(self.clipped.finish()),
            total,
            steps,
            wall,
            cpu,
            source,
            bytes_in,
            bytes_out,
            rss,
            reset_obs,
            reset_info,
            Arc::new(self.actions.finish()),
            Arc::new(self.observations.finish()),
            Arc::new(self.rewards.finish()),
            Arc::new(self.dones.finish()),
            Arc::new(self.truncateds.finish()),
            Arc::new(self.infos.finish()),
            Arc::new(self.step_errors.finish()),
            Arc::new(self.step_s.finish()),
        ];
        *self = Shard::sized(sizes);
        RecordBatch::try_new(schema(), columns).map_err(|e| e.to_string())
    }

    /// Write the shard's rows to `path` (the builders are emptied either way).
    pub fn write(&mut self, path: &str) -> Result<(), WriteError> {
        let batch = self.batch().map_err(WriteError::Other)?;
        let file = File::create(path).map_err(WriteError::Io)?;
        let mut props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(ZstdLevel::default()))
            .set_dictionary_enabled(false)
            .set_statistics_enabled(EnabledStatistics::None);
        for name in DICTIONARY {
            props = props.set_column_dictionary_enabled(ColumnPath::from(name), true);
        }
        for (name, k) in SCALARS {
            if k != b'j' {
                props = props
                    .set_column_statistics_enabled(ColumnPath::from(name), EnabledStatistics::Page);
            }
        }
        let mut w = ArrowWriter::try_new(file, batch.schema(), Some(props.build()))
            .map_err(to_write_error)?;
        w.write(&batch).map_err(to_write_error)?;
        w.close().map_err(to_write_error)?;
        Ok(())
    }
}

pub enum WriteError {
    Io(std::io::Error),
    Other(String),
}

fn to_write_error(e: parquet::errors::ParquetError) -> WriteError {
    match e {
        parquet::errors::ParquetError::External(inner) => {
            match inner.downcast::<std::io::Error>() {
                Ok(io) => WriteError::Io(*io),
                Err(other) => WriteError::Other(other.to_string()),
            }
        }
        other => WriteError::Other(other.to_string()),
    }
}
