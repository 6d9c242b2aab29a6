-- finish.lua: store a batch's outcomes, with their webhooks, events, samples and response-cache
-- entries, note its faults, and acknowledge its stored jobs, in one atomic step
-- (`sluice.wire.streams.StreamConsumer.finish`, arguments by
-- `sluice.wire.script_calls.finish_call`).
--
-- KEYS[1]: the version's webhook outbox
-- KEYS[2]: its samples stream
-- KEYS[3]: its online stream
-- KEYS[4]: its bulk stream
-- KEYS[5]: its deadline index
-- KEYS[6..]: per job, its hash; then the hashes of the faulted jobs
-- Every key is of the version's slot (`sluice.wire.keys`; a response-cache key too), so the
-- script runs on a Redis Cluster.
--
-- ARGV[1]: ttl_s of the job records
-- ARGV[2]: the events channel, the prefix of each job's own channel (lib/job_changed.lua)
-- ARGV[3]: the consumer group
-- ARGV[4]: the samples' cap (MAXLEN ~)
-- ARGV[5]: started_at
-- ARGV[6]: finished_at
-- ARGV[7]: model_ms
-- ARGV[8]: batch_size
-- ARGV[9]: close_reason
-- ARGV[10]: the number of jobs
-- ARGV[11..]: per job: its id, lane (1 online, 2 bulk), entry id, status, output or '', error or
--   '', '1' to announce it or '', the facts of an output written to its output_uri or '', its
--   cold_start_ms or '' (it waited for a version woken from zero), then its sample (its number of
--   fields, then the fields); then one message per faulted job
--
-- Returns: per job, 1 where this write made it final, else 0.
--
-- Each outcome is written once (a job already final is left as it is), and only the write that
-- wins adds the job's webhook, event and sample, so a job processed twice has one of each (and the
-- worker queues a shadow copy only for a write that won); a success whose record names a
-- response-cache key (set at submission, `sluice.wire.response_cache`) stores its output there.
-- Then every job's entry is acknowledged and deleted: never before its outcome is stored. A
-- faulted job gets no outcome and keeps its entry; its message is noted for its dead letter and
-- among its attempts' errors (`worker_error`).
--
-- Status `queued` is a retry the worker decided on (`sluice.retry`): the attempt's error is noted,
-- the job queued again under a new entry with the old one's fields (and its deadline indexed
-- again: a retry must start by it too), announced, and nothing else written (no sample, no
-- webhook: the job is not final). Its tenant's quota is not charged again.
--!include lib/queue_webhook.lua
--!include lib/job_changed.lua
--!include lib/ack_and_drop.lua
--!include lib/note_attempt.lua
local ttl, channel = tonumber(ARGV[1]), ARGV[2]
local k, a = 6, 11
local function requeue(job, lane, entry, err)
  local old = redis.call('XRANGE', KEYS[lane + 2], entry, entry)
  if #old == 0 then return false end
  note_attempt(job, cjson.decode(err), ARGV[6])
  redis.call('HSET', job, 'status', 'queued')
  redis.call('XADD', KEYS[lane + 2], '*', unpack(old[1][2]))
  local deadline = redis.call('HGET', job, 'deadline')
  if deadline then redis.call('ZADD', KEYS[5], deadline, job) end
  return true
end
local won, acks = {}, {{}, {}}
for j = 1, tonumber(ARGV[10]) do
  local job, id, lane, entry, status = KEYS[k], ARGV[a], tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 3]
  local output, err, announce, written, cold = ARGV[a + 4], ARGV[a + 5], ARGV[a + 6], ARGV[a + 7], ARGV[a + 8]
  local sample = a + 10
  a = sample + 2 * tonumber(ARGV[a + 9])
  local s = redis.call('HGET', job, 'status')
  won[j] = 0
  if s == 'running' and status == 'queued' and requeue(job, lane, entry, err) then
    if announce ~= '' then job_changed(channel, job, id, 'queued') end
  elseif s == 'queued' or s == 'running' then
    -- A retry whose entry is gone (trimmed, or its version's streams dropped) fails instead.
    if status == 'queued' then status = 'failed' end
    redis.call('HSET', job, 'status', status, 'finished_at', ARGV[6], 'model_ms', ARGV[7], 'batch_size', ARGV[8],
      'close_reason', ARGV[9], 'started_at', ARGV[5])
    if output ~= '' then redis.call('HSET', job, 'output', output) end
    if err ~= '' then redis.call('HSET', job, 'error', err) end
    if written ~= '' then redis.call('HSET', job, 'output_written', written) end
    if cold ~= '' then redis.call('HSET', job, 'cold_start_ms', cold) end
    local cache = redis.call('HMGET', job, 'cache_key', 'cache_ttl_s')
    if cache[1] and status == 'succeeded' and output ~= '' then
      redis.call('SET', cache[1], output, 'EX', cache[2])
    end
    queue_webhook(job, KEYS[1])
    redis.call('EXPIRE', job, ttl)
    if announce ~= '' then job_changed(channel, job, id, status) end
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, sample, a - 1))
    won[j] = 1
  end
  k = k + 1
  table.insert(acks[lane], entry)
end
ack_and_drop(acks, ARGV[3])
for f = k, #KEYS do
  if redis.call('EXISTS', KEYS[f]) == 1 then
    redis.call('HSET', KEYS[f], 'last_error', ARGV[a])
    note_attempt(KEYS[f], {code = 'worker_error', message = ARGV[a]}, ARGV[6])
  end
  a = a + 1
end
return won
