-- add_entry(stream, added, job, fields): write a job's entry to its lane's stream, numbered: the
-- job takes the lane's next number (`sluice.wire.keys.queue_added`), `seq` in its record and `sq`
-- in its entry, in the order entries enter the stream, so that a job's place is its number less
-- the highest number read. Used when a job is queued (lib/queue_jobs.lua) and when it is
-- released from its tenant's held queue (release.lua).
--
-- KEYS: none of its own; the caller's stream, count and record keys, passed in.
-- ARGV: none of its own; `fields`, the entry's name, value pairs.
local function add_entry(stream, added, job, fields)
  local seq = redis.call('ZINCRBY', added, 1, stream)
  redis.call('HSET', job, 'seq', seq)
  redis.call('XADD', stream, '*', 'sq', seq, unpack(fields))
end
