-- release.lua: move held jobs of one lane into its stream, in the order the caller's fair plan
-- gives (`sluice.fair_share.plan_release`, by `sluice.wire.streams.StreamConsumer.release`), and
-- answer what is held now.
--
-- KEYS[1]: the lane's stream
-- KEYS[2]: the version's count of jobs written per lane (`sluice.wire.keys.queue_added`)
-- KEYS[3]: the lane's held index (`sluice.wire.keys.held_index`): queue name -> jobs held, '*' ->
--   all of them
--
-- ARGV[1]: the prefix of the lane's held queues' keys, of the slot
-- ARGV[2..]: pairs of a held queue's name (`priority|tenant`) and how many of its jobs to release
--
-- Returns: the held queues now, a flat list of name, count, and its first job's enqueued_at, cost
-- and tenant share.
--
-- A held job that is no longer queued (cancelled, expired, withdrawn, its record gone) leaves its
-- queue without an entry: its state was settled by the script that changed it.
--!include lib/add_entry.lua
local stream, added, index, prefix = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local gone = 0
for p = 2, #ARGV, 2 do
  local queue, want = ARGV[p], tonumber(ARGV[p + 1])
  local taken = 0
  while taken < want do
    local job = redis.call('LPOP', prefix .. queue)
    if not job then break end
    taken = taken + 1
    local state = redis.call('HMGET', job, 'status', 'ef')
    if state[1] == 'queued' and state[2] then
      redis.call('HDEL', job, 'ef')
      add_entry(stream, added, job, cjson.decode(state[2]))
    end
  end
  if taken > 0 then
    gone = gone + taken
    if redis.call('HINCRBY', index, queue, -taken) <= 0 then redis.call('HDEL', index, queue) end
  end
end
if gone > 0 and redis.call('HINCRBY', index, '*', -gone) <= 0 then redis.call('HDEL', index, '*') end
local held = {}
local counts = redis.call('HGETALL', index)
for f = 1, #counts, 2 do
  local queue = counts[f]
  if queue ~= '*' then
    local head = redis.call('LINDEX', prefix .. queue, 0)
    local facts = head and redis.call('HMGET', head, 'enqueued_at', 'cost', 'share') or {}
    held[#held + 1] = queue
    held[#held + 1] = counts[f + 1]
    held[#held + 1] = facts[1] or '0'
    held[#held + 1] = facts[2] or '0'
    held[#held + 1] = facts[3] or '1'
  end
end
return held
